"""Expert-load heatmap and TensorBoard scalars from real router stats."""

from __future__ import annotations

import pytest
import torch

import moecompile as mc
from moecompile.errors import MoecompileError
from moecompile.load_plots import ExpertLoadRecorder, load_imbalance, plot_expert_load
from moecompile.models import build_model

LAYERS = ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.fixture(scope="module")
def result():
    model, (ids,) = build_model("tiny-llama")
    return mc.convert(model, {"experts": {"num_experts": 4, "top_k": 2, "aux_loss": "aux", "z_loss_coeff": 0.001}}, (ids,))


def test_load_imbalance():
    assert load_imbalance(torch.tensor([4, 4, 4, 4])) == 1.0
    assert load_imbalance(torch.tensor([16, 0, 0, 0])) == 4.0
    assert load_imbalance(torch.tensor([0, 0])) == 1.0


def test_heatmap_over_steps(result, tmp_path):
    recorder = ExpertLoadRecorder()
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        result.module(torch.randint(0, 128, (2, 8), generator=g))
        scalars = recorder.record(step, result.router_stats)
        assert set(scalars) >= {f"load_imbalance/{layer}" for layer in LAYERS} | {"router/aux_loss", "router/z_loss"}
    m = recorder.matrix(LAYERS[1])
    assert m.shape == (4, 5) and torch.allclose(m.sum(0), torch.ones(5))
    raw = recorder.matrix(LAYERS[1], normalize=False)
    assert torch.equal(raw[:, -1], result.expert_load()[LAYERS[1]].float())
    assert raw.sum(0).tolist() == [16 * 2] * 5  # T * k token copies each step
    png = recorder.heatmap(tmp_path / "load.png")
    from matplotlib.image import imread

    assert imread(png).shape[1] > 400
    with pytest.raises(MoecompileError, match="not after the last recorded step"):
        recorder.record(2, result.router_stats)


def test_tensorboard_scalars(result, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result.module(result.example_inputs[0])
    want_aux = float(result.router_stats.losses[LAYERS[0]]["aux_loss"].detach())
    want_imb = load_imbalance(result.expert_load()[LAYERS[0]])
    with ExpertLoadRecorder(log_dir=tmp_path / "tb") as recorder:
        recorder.record(7, result.router_stats)
        recorder.record(8, {layer: torch.tensor([32, 0, 0, 0]) for layer in LAYERS})
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"router/aux_loss/{LAYERS[0]}", "router/aux_loss", "router/z_loss", f"load_imbalance/{LAYERS[0]}", "load_imbalance/max"} <= tags
    aux = events.Scalars(f"router/aux_loss/{LAYERS[0]}")
    assert [e.step for e in aux] == [7] and aux[0].value == pytest.approx(want_aux)
    imb = events.Scalars(f"load_imbalance/{LAYERS[0]}")
    assert [(e.step, round(e.value, 5)) for e in imb] == [(7, round(want_imb, 5)), (8, 4.0)]


def test_plot_expert_load_and_errors(tmp_path):
    loads = [{"l0": torch.tensor([1, 2, 3])}, {"l0": torch.tensor([3, 2, 1])}]
    assert plot_expert_load(loads, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(MoecompileError, match="no expert load recorded"):
        ExpertLoadRecorder().heatmap(tmp_path / "x.png")
    with pytest.raises(MoecompileError, match="run the converted module once"):
        ExpertLoadRecorder().record(0, {})
