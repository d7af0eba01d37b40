"""Expert load over training: a per-layer heatmap (PNG) and TensorBoard scalars.

    recorder = ExpertLoadRecorder(log_dir="runs/exp1")       # log_dir optional
    for step, batch in enumerate(data):
        ...; recorder.record(step, result.router_stats)      # after each forward
    recorder.heatmap("expert_load.png")                      # experts x steps, per layer
    recorder.close()

TensorBoard tags: ``router/<loss>/<layer>`` and ``router/<loss>`` (mean over layers) for
each router loss, ``load_imbalance/<layer>`` (max / mean tokens per expert: 1.0 is
perfectly even, E means one expert took everything) and ``load_imbalance/max``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from .errors import MoecompileError


def load_imbalance(load_E: torch.Tensor) -> float:
    """max / mean of tokens per expert (1.0 = even; 0 tokens counts as even)."""
    load = load_E.detach().float()
    mean = float(load.mean())
    return float(load.max()) / mean if mean > 0 else 1.0


class ExpertLoadRecorder:
    """Tokens per expert for every MoE layer at every recorded step, plus router losses."""

    def __init__(self, log_dir: str | Path | None = None):
        self.steps: list[int] = []
        self.load: dict[str, list[torch.Tensor]] = {}  # layer -> [E] per recorded step
        self.losses: dict[str, dict[str, list[float]]] = {}  # loss name -> layer -> per step
        self._writer = _summary_writer(log_dir) if log_dir is not None else None

    def record(self, step: int, stats: Any, losses: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, float]:
        """Add one step from ``RouterStats`` (or a ``{layer: load_E}`` mapping and optional
        ``{layer: {loss: value}}``); returns the scalars it logged."""
        load = getattr(stats, "load", stats)
        losses = getattr(stats, "losses", None) if losses is None else losses
        if not isinstance(load, Mapping) or not load:
            raise MoecompileError(
                "record() needs the router stats of a forward (result.router_stats) or a {layer: tokens per expert} "
                "mapping; got nothing: run the converted module once before recording"
            )
        if self.steps and step <= self.steps[-1]:
            raise MoecompileError(f"step {step} is not after the last recorded step {self.steps[-1]}")
        self.steps.append(step)
        scalars: dict[str, float] = {}
        for layer, load_E in load.items():
            self.load.setdefault(layer, []).append(torch.as_tensor(load_E).detach().float().cpu())
            scalars[f"load_imbalance/{layer}"] = load_imbalance(torch.as_tensor(load_E))
        scalars["load_imbalance/max"] = max(v for k, v in scalars.items() if k.startswith("load_imbalance/"))
        by_loss: dict[str, list[float]] = {}
        for layer, per_layer in (losses or {}).items():
            for name, value in per_layer.items():
                v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
                self.losses.setdefault(name, {}).setdefault(layer, []).append(v)
                scalars[f"router/{name}/{layer}"] = v
                by_loss.setdefault(name, []).append(v)
        for name, values in by_loss.items():
            scalars[f"router/{name}"] = sum(values) / len(values)
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
        return scalars

    def matrix(self, layer: str, normalize: bool = True) -> torch.Tensor:
        """[E, steps]: tokens per expert at each recorded step (as a share of the step's tokens)."""
        if layer not in self.load:
            raise MoecompileError(f"no load recorded for layer {layer!r}; recorded: {', '.join(self.load) or 'none'}")
        m = torch.stack(self.load[layer], dim=1)
        if normalize:
            m = m / m.sum(0, keepdim=True).clamp_min(1)
        return m

    def heatmap(self, path: str | Path, normalize: bool = True, cols: int = 4) -> Path:
        """One panel per MoE layer: experts (rows) x steps (columns), colour = share of tokens."""
        if not self.load:
            raise MoecompileError("no expert load recorded yet: call record(step, result.router_stats) first")
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise MoecompileError("heatmaps need matplotlib: pip install 'moecompile[viz]'") from e
        layers = list(self.load)
        cols = min(cols, len(layers))
        rows = math.ceil(len(layers) / cols)
        fig = Figure(figsize=(4.2 * cols, 2.8 * rows), layout="constrained")  # no pyplot: no global state
        FigureCanvasAgg(fig)
        axes = fig.subplots(rows, cols, squeeze=False)
        vmax = max(float(self.matrix(layer, normalize).max()) for layer in layers) or 1.0
        image = None
        for ax, layer in zip(axes.flat, layers):
            m = self.matrix(layer, normalize).numpy()
            image = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=vmax,
                              extent=(self.steps[0] - 0.5, self.steps[-1] + 0.5, m.shape[0] - 0.5, -0.5))
            ax.set_title(f"{layer}  (imbalance {load_imbalance(self.load[layer][-1]):.2f} at step {self.steps[-1]})", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel("expert", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(layers):]:
            ax.axis("off")
        fig.colorbar(image, ax=axes, label="share of tokens" if normalize else "tokens", shrink=0.9)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        return path

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "ExpertLoadRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _summary_writer(log_dir: str | Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise MoecompileError("TensorBoard logging needs the tensorboard package: pip install 'moecompile[viz]'") from e
    return SummaryWriter(log_dir=str(log_dir))


def plot_expert_load(loads: list[Mapping[str, torch.Tensor]], path: str | Path, steps: list[int] | None = None) -> Path:
    """Heatmap of a list of per-step ``{layer: tokens per expert}`` (e.g. collected expert_load())."""
    recorder = ExpertLoadRecorder()
    for i, load in enumerate(loads):
        recorder.record(steps[i] if steps else i, load)
    return recorder.heatmap(path)
