"""The converted model trains: ~50 CPU steps lower the loss, and every expert parameter learns."""

import torch

import moecompile as mc


def test_fifty_steps_lower_the_loss(llama):
    torch.manual_seed(0)
    # a learnable toy language: each token is followed by (token * 3 + 1) mod vocab
    x = torch.randint(0, 128, (8, 16))
    y = (x * 3 + 1) % 128
    plan = {"experts": {"num_experts": 4, "top_k": 2, "aux_loss": "aux", "z_loss_coeff": 1e-3, "router_noise": 0.01}}
    result = mc.convert(llama, plan, (x,))
    opt = torch.optim.AdamW(result.module.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        logits = result.module(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), y.reshape(-1)) + result.router_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    w = dict(result.module.named_parameters())["model.layers.0.mlp.experts.w_gate_up"]
    assert w.grad is not None and torch.isfinite(w.grad).all()
