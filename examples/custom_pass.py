"""A user-written pass: measure router entropy per MoE layer, registered and run by convert().

The pass finds each layer's router logits through the node metadata contract
(``meta["moe"]["role"] == "router"``), inserts the entropy computation after them,
and returns it as a side output, so every forward reports it next to expert load.

    python examples/custom_pass.py
"""

from __future__ import annotations

import torch
import torch.fx as fx
import transformers

import moecompile as mc
from moecompile.graph import inline, trace_block
from moecompile.meta import Role, nodes_with_role
from moecompile.outputs import add_side_outputs


def _entropy(logits_TE: torch.Tensor) -> torch.Tensor:
    p = logits_TE.float().softmax(-1)
    return -(p * p.clamp_min(1e-9).log()).sum(-1).mean()


@mc.register_pass("router_entropy", after="upcycle", requires=("moe",))
def router_entropy(gm: fx.GraphModule, ctx: mc.PassContext) -> fx.GraphModule:
    routers = [n for n in nodes_with_role(gm.graph, Role.ROUTER) if n.target == torch.ops.aten.linear.default]
    for logits in routers:
        layer = logits.meta["moe"]["layer"]
        block = trace_block(_entropy, {"logits_TE": torch.zeros(logits.meta["val"].shape)})
        entropy = inline(gm.graph, block, [logits], anchor=logits.next)
        entropy.meta["moe"] = {"layer": layer, "role": Role.ROUTER_LOSS}
        add_side_outputs(gm, layer, {"router_entropy": entropy})
        ctx.decide(f"{layer}: router entropy reported as a side output")
    return gm


def main() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 16))
    result = mc.convert(model, {"experts": {"num_experts": 8, "top_k": 2}}, (ids,), passes=["router_entropy"])
    print(result.report())
    result.module(ids)
    for layer, metrics in result.router_stats.metrics.items():
        print(f"{layer}: router entropy {metrics['router_entropy'].item():.3f} nats (uniform: {torch.log(torch.tensor(8.0)):.3f})")


if __name__ == "__main__":
    main()
