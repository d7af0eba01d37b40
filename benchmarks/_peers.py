"""Adapters that build each MoE implementation from one shared set of weights.

Every builder takes the same `Weights` (router [E, H], w_gate_up [E, 2F, H] with gate
rows first, w_down [E, H, F]) and returns a callable `x_TH -> y_TH` plus the
parameters it trains, so the timing loop and the float64 reference treat every
implementation identically. A peer that cannot be imported raises `Unavailable` with
the reason, which the runner prints instead of dropping the row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

logging.getLogger("transformers").setLevel(logging.ERROR)


class Unavailable(RuntimeError):
    """This implementation cannot be built here (the message says why)."""


@dataclass
class Weights:
    router: torch.Tensor     # [E, H]
    w_gate_up: torch.Tensor  # [E, 2F, H], gate rows then up rows
    w_down: torch.Tensor     # [E, H, F]
    x: torch.Tensor          # [T, H]
    grad_out: torch.Tensor   # [T, H]


def make_weights(H: int, F_: int, E: int, T: int, seed: int = 0) -> Weights:
    """Deterministic float64 weights and tokens: the same bits in every worker process."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, fan: torch.randn(*s, generator=g, dtype=torch.float64) / fan ** 0.5  # noqa: E731
    return Weights(router=r(E, H, fan=H), w_gate_up=r(E, 2 * F_, H, fan=H), w_down=r(E, H, F_, fan=F_),
                   x=r(T, H, fan=1), grad_out=r(T, H, fan=T))


Built = tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.nn.Parameter]]


def _moecompile(w: Weights, k: int, dtype: torch.dtype, apply_weights: str = "auto") -> Built:
    import moecompile as mc

    E, F2, H = w.w_gate_up.shape

    class FFN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(H, F2 // 2, bias=False)
            self.up_proj = torch.nn.Linear(H, F2 // 2, bias=False)
            self.down_proj = torch.nn.Linear(F2 // 2, H, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = FFN()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x)

    dense = Block().to(dtype)
    plan = mc.Plan.from_dict({"experts": {"num_experts": E, "top_k": k, "aux_loss": "none", "apply_weights": apply_weights}})
    # [1, T, H] like a model's hidden states
    result = mc.convert(dense, plan, (w.x.to(dtype)[None],))
    params = dict(result.module.named_parameters())
    with torch.no_grad():
        params["mlp.experts.w_gate_up"].copy_(w.w_gate_up)
        params["mlp.experts.w_down"].copy_(w.w_down)
        params["mlp.router.weight"].copy_(w.router)
    return (lambda x: result.module(x[None])[0]), list(params.values())


def _hf(cls_path: str, config_cls: str, w: Weights, k: int, dtype: torch.dtype, impl: str, **cfg) -> Built:
    try:
        import importlib

        import transformers
    except ImportError as e:  # pragma: no cover - depends on the env
        raise Unavailable(f"transformers not importable ({e}); pip install -e '.[bench]'") from e
    mod_name, cls_name = cls_path.rsplit(".", 1)
    block_cls = getattr(importlib.import_module(f"transformers.models.{mod_name}"), cls_name)
    E, F2, H = w.w_gate_up.shape
    config = getattr(transformers, config_cls)(hidden_size=H, num_experts_per_tok=k, experts_implementation=impl,
                                               **cfg)
    torch.manual_seed(0)  # weights not in Weights (DeepSeek's shared expert) match between timed and reference build
    block = block_cls(config).to(dtype)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w.w_gate_up)
        block.experts.down_proj.copy_(w.w_down)
        block.gate.weight.copy_(w.router)
    return (lambda x: block(x[None])[0]), [p for p in block.parameters() if p.requires_grad]


def _mixtral(w: Weights, k: int, dtype: torch.dtype, impl: str) -> Built:
    E, F2, _ = w.w_gate_up.shape
    return _hf("mixtral.modeling_mixtral.MixtralSparseMoeBlock", "MixtralConfig", w, k, dtype, impl,
               intermediate_size=F2 // 2, num_local_experts=E, router_jitter_noise=0.0)


def _qwen3(w: Weights, k: int, dtype: torch.dtype, impl: str) -> Built:
    E, F2, _ = w.w_gate_up.shape
    return _hf("qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "Qwen3MoeConfig", w, k, dtype, impl,
               moe_intermediate_size=F2 // 2, num_experts=E, norm_topk_prob=True)


def _deepseek(w: Weights, k: int, dtype: torch.dtype, impl: str) -> Built:
    """DeepSeek-V3 routing (sigmoid, one group, no scaling) and one shared expert it cannot switch off."""
    E, F2, _ = w.w_gate_up.shape
    return _hf("deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE", "DeepseekV3Config", w, k, dtype, impl,
               moe_intermediate_size=F2 // 2, n_routed_experts=E, n_shared_experts=1, n_group=1, topk_group=1,
               routed_scaling_factor=1.0, norm_topk_prob=True)


def _dense_swiglu(w: Weights, k: int, dtype: torch.dtype) -> Built:
    """The limit with zero routing cost: one SwiGLU (expert 0's weights) over T*k tokens."""
    wgu = torch.nn.Parameter(w.w_gate_up[0].to(dtype).clone())
    wd = torch.nn.Parameter(w.w_down[0].to(dtype).clone())

    def fn(x: torch.Tensor) -> torch.Tensor:
        xk = x.repeat_interleave(k, dim=0)
        gate, up = F.linear(xk, wgu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, wd).view(x.shape[0], k, -1).sum(1)

    return fn, [wgu, wd]


def _torchtitan(w: Weights, k: int, dtype: torch.dtype) -> Built:
    """torchtitan's MoE (``models.common.moe``): softmax top-k renormalised (route_norm), the local token
    dispatcher and ``torch._grouped_mm`` experts. Its experts always compute in bf16 (their code casts)."""
    try:
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import (MoE, GroupedExperts, LocalTokenDispatcher, RoutedExperts,
                                                  TokenChoiceTopKRouter)
    except ImportError as e:
        raise Unavailable(f"torchtitan not importable ({e}); benchmarks/README.md says how to install it "
                          "without pulling another torch") from e
    E, F2, H = w.w_gate_up.shape
    F_ = F2 // 2
    config = MoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=H, hidden_dim=F_, num_experts=E),
                                            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=H, out_features=E),
                                            top_k=k, score_func="softmax", route_norm=True))
    block = config.build().to(dtype)
    experts = block.routed_experts.inner_experts
    with torch.no_grad():
        experts.w1_EFD.copy_(w.w_gate_up[:, :F_])
        experts.w3_EFD.copy_(w.w_gate_up[:, F_:])
        experts.w2_EDF.copy_(w.w_down)
        block.router.gate.weight.copy_(w.router)
    return (lambda x: block(x[None])[0]), [p for p in block.parameters() if p.requires_grad]


def _deepspeed(w: Weights, k: int, dtype: torch.dtype) -> Built:
    """DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``): GShard-style gating, dropless (drop_tokens=False:
    capacity = the busiest expert's count, every other expert padded to it), one SwiGLU module per expert run
    in turn; no random token selection or sampled second expert, so it routes as the others do."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.moe.layer import MoE
    except ImportError as e:
        raise Unavailable(f"deepspeed not importable ({e}); benchmarks/README.md says how to install it "
                          "without building its CUDA ops") from e
    import torch.distributed as dist

    if not dist.is_initialized():  # its expert groups live in torch.distributed: a world of one
        from moecompile.distributed import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    E, F2, H = w.w_gate_up.shape
    F_ = F2 // 2

    class SwiGLU(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(H, F_, bias=False)
            self.up = torch.nn.Linear(H, F_, bias=False)
            self.down = torch.nn.Linear(F_, H, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.silu(self.gate(x)) * self.up(x))

    block = MoE(hidden_size=H, expert=SwiGLU(), num_experts=E, ep_size=1, k=k, drop_tokens=False, use_rts=False,
                top2_2nd_expert_sampling=False).to(dtype)
    with torch.no_grad():
        for e, expert in enumerate(block.deepspeed_moe.experts.deepspeed_experts):
            expert.gate.weight.copy_(w.w_gate_up[e, :F_])
            expert.up.weight.copy_(w.w_gate_up[e, F_:])
            expert.down.weight.copy_(w.w_down[e])
        block.deepspeed_moe.gate.wg.weight.copy_(w.router)
    return (lambda x: block(x[None])[0][0]), [p for p in block.parameters() if p.requires_grad]


# the float64 reference of a peer that cannot compute in float64 itself (torchtitan's experts cast to bf16)
# or whose float64 run is just slow: an implementation of the same function (softmax top-k, renormalised)
REFERENCES = {"torchtitan": "hf_mixtral_eager", "deepspeed": "hf_mixtral_eager"}

BUILDERS: dict[str, Callable[[Weights, int, torch.dtype], Built]] = {
    "moecompile": _moecompile,  # routing weights in the GLU (apply_weights auto)
    "moecompile_combine_weights": lambda w, k, d: _moecompile(w, k, d, "combine"),  # ... in the combine
    "hf_mixtral_eager": lambda w, k, d: _mixtral(w, k, d, "eager"),
    "hf_mixtral_grouped_mm": lambda w, k, d: _mixtral(w, k, d, "grouped_mm"),
    "hf_qwen3_grouped_mm": lambda w, k, d: _qwen3(w, k, d, "grouped_mm"),
    "hf_qwen3_eager": lambda w, k, d: _qwen3(w, k, d, "eager"),
    "hf_deepseek_v3_grouped_mm": lambda w, k, d: _deepseek(w, k, d, "grouped_mm"),
    "hf_deepseek_v3_eager": lambda w, k, d: _deepseek(w, k, d, "eager"),
    "torchtitan": _torchtitan,
    "deepspeed": _deepspeed,
    "dense_swiglu_Tk": _dense_swiglu,
}
