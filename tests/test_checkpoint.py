"""Checkpoints: bitwise resume, crash-safe saves, named errors, and loading across expert-parallel sizes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import moecompile as mc
from moecompile.checkpoint import CheckpointError, read_meta
from moecompile.data import ByteBatches, stdlib_bytes
from moecompile.models import build_model

TESTS = Path(__file__).parent
BATCH, SEQ = 4, 16


def make(num_experts: int = 4, hidden: int = 32, **experts) -> mc.TrainStep:
    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=BATCH, seq_len=SEQ, hidden_size=hidden)
    plan = {"experts": {"num_experts": num_experts, "top_k": 2, "router_noise": 0.02, "expert_bias": True, **experts}}
    return mc.build_train_step(mc.convert(dense, plan, (ids,)), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))


def stream() -> ByteBatches:
    return ByteBatches(stdlib_bytes(300_000), BATCH, SEQ, seed=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[float], dict[str, torch.Tensor]]:
    """Train 3 steps, save, then 2 more: the checkpoint, the uninterrupted losses, the state at the save."""
    path = tmp_path_factory.mktemp("ckpt") / "run"
    data = stream()
    step = make()
    for i in range(3):
        step(data[i])
    step.save(path)
    state = {n: t.detach().clone() for n, t in [*step.module.named_parameters(), *step.module.named_buffers()]}
    losses = [step(data[i]).loss for i in (3, 4)]
    return path, losses, state


def test_resume_gives_the_same_losses_bitwise(saved):
    path, losses, state = saved
    step = make()
    step.load(path)
    assert step.step_count == 3
    for n, t in [*step.module.named_parameters(), *step.module.named_buffers()]:
        assert torch.equal(t, state[n]), n  # expert biases included
    data = stream()
    assert [step(data[i]).loss for i in (3, 4)] == losses
    meta = read_meta(path)
    assert meta["step"] == 3 and meta["ep"] == 1
    assert "model/model.layers.0.mlp.experts.w_gate_up#3" in meta["crc32"]  # experts stored by global id


CRASH = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import torch.distributed.checkpoint.filesystem as fs
from test_checkpoint import make, stream
data, step = stream(), make()
step(data[0])
step.save({path!r})
torch.save({{n: p.detach().clone() for n, p in step.module.named_parameters()}}, {good!r})
step(data[1])
original, written = fs._write_item, [0]
def write_then_die(*args, **kwargs):
    out = original(*args, **kwargs)
    written[0] += 1
    if written[0] == 6:
        os._exit(3)   # a hard crash in the middle of writing: no finally, no cleanup
    return out
fs._write_item = write_then_die
step.save({path!r})
"""


def test_a_crash_during_save_never_destroys_the_last_good_checkpoint(tmp_path):
    path, good = tmp_path / "run", tmp_path / "good.pt"
    code = textwrap.dedent(CRASH.format(tests=str(TESTS), path=str(path), good=str(good)))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", code], timeout=240, env=env, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (path.with_name("run.tmp")).exists() and not (path.with_name("run.tmp") / "moecompile.json").exists()
    step = make()
    step.load(path)  # the save that crashed left the good one alone
    params = torch.load(good)
    for n, p in step.module.named_parameters():
        assert torch.equal(p, params[n]), n
    assert step.step_count == 1
    with pytest.raises(CheckpointError, match="not a complete moecompile checkpoint"):
        step.load(path.with_name("run.tmp"))
    step(stream()[1])
    step.save(path)  # the next save replaces the crashed temporary
    assert read_meta(path)["step"] == 2 and not path.with_name("run.tmp").exists()


def test_a_crash_between_the_renames_loads_the_previous(saved, tmp_path):
    import shutil

    path, _, state = saved
    prev = tmp_path / "run.prev"
    shutil.copytree(path, prev)  # as if save died after moving the old one aside
    step = make()
    step.load(tmp_path / "run")
    assert step.step_count == 3
    assert torch.equal(dict(step.module.named_parameters())["lm_head.weight"], state["lm_head.weight"])


def test_corrupt_bytes_name_the_tensor(saved, tmp_path):
    import shutil

    path = tmp_path / "run"
    shutil.copytree(saved[0], path)
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    index, info = max(storage.items(), key=lambda kv: kv[1].length)  # the largest tensor's bytes
    data_file = path / info.relative_path
    raw = bytearray(data_file.read_bytes())
    raw[info.offset + info.length // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"tensor '{index.fqn}' is corrupt: its bytes have CRC-32"):
        make().load(path)
    data_file.write_bytes(bytes(raw[: len(raw) // 3]))  # truncated
    with pytest.raises(CheckpointError, match=r"tensor '.*' is corrupt: it lies at bytes .* has only \d+ bytes"):
        make().load(path)
    (path / "moecompile.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete"):
        make().load(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        make().load(tmp_path / "nowhere")


def test_a_mismatched_model_names_the_tensor_and_the_mismatch(saved):
    path = saved[0]
    with pytest.raises(CheckpointError, match=r"'model/model.layers.0.mlp.experts.w_\w+#4' .* holds experts 0..3 .* "
                                              r"wants expert 4; the number of experts differs"):
        make(num_experts=8).load(path)
    with pytest.raises(CheckpointError, match=r"tensor 'model/model.embed_tokens.weight': the checkpoint has shape "
                                              r"\(256, 32\), the model has \(256, 64\)"):
        make(hidden=64).load(path)


# ---------------------------------------------------------------- across expert-parallel sizes


@pytest.mark.distributed
def test_an_ep2_checkpoint_loads_at_ep1_and_continues_the_run():
    from _ep_scenario import EXPERTS, STEPS, data, ep2_results, make_step

    out, ranks = ep2_results()
    meta = read_meta(out / "ckpt")
    assert meta["ep"] == 2 and meta["world_size"] == 2 and meta["step"] == STEPS
    _, result, step = make_step({"experts": EXPERTS}, 4)
    step.load(out / "ckpt")  # each rank wrote its two experts; ep = 1 reads all four
    assert step.step_count == STEPS
    m = step(data()[STEPS])
    assert m.loss == pytest.approx(ranks[0]["after"]["loss"], rel=1e-5)
    assert m.expert_load == ranks[0]["after"]["load"]


def _continues(ranks: list[dict], ep: int, want: dict) -> None:
    for r in ranks:
        assert r[ep]["step_count"] == 3
        assert r[ep]["loss"] == pytest.approx(want["loss"], rel=1e-5), (ep, r[ep]["loss"], want["loss"])
        assert r[ep]["load"] == want["load"]


@pytest.mark.distributed
def test_an_ep2_checkpoint_loads_at_ep4():
    from _ep_scenario import ep2_results, four_ranks_from_checkpoint

    out, ranks = ep2_results()
    _continues(four_ranks_from_checkpoint(out / "ckpt", (4,)), 4, ranks[0]["after"])


@pytest.mark.slow
@pytest.mark.distributed
def test_an_ep2_checkpoint_loads_at_ep2_on_four_ranks_with_edp2():
    from _ep_scenario import ep2_results, four_ranks_from_checkpoint

    out, ranks = ep2_results()
    four = four_ranks_from_checkpoint(out / "ckpt", (2, 4))
    _continues(four, 2, ranks[0]["after"])
    assert four[0][2]["collectives"] > four[0][4]["collectives"]  # edp = 2 adds the expert-gradient buckets
