"""``moecompile train`` end to end: spawned ep=2 ranks train (ZeRO-3, bf16 AdamW moments), log, checkpoint, summarise;
--resume continues."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

FAST = ["--model", "tiny-llama", "--batch", "4", "--seq", "16", "--log-every", "1"]


def moecompile(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "moecompile", *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.distributed
def test_train_five_steps_on_two_ranks_then_resume_on_one(tmp_path):
    out = tmp_path / "run"
    zero3 = [f"parallel.shard_{what}=true" for what in ("optimizer", "gradients", "parameters")]
    proc = moecompile("train", "--steps", "5", *FAST, "--out", str(out), *(a for z in zero3 for a in ("--set", z)),
                      "--adam-moments", "bf16", "--export-hf", str(tmp_path / "hf"), cwd=tmp_path)
    text = proc.stdout
    assert "8 experts top-2" in text and "ep=2 over 2 rank(s)" in text, text
    lines = re.findall(r"step +(\d+) +loss ([\d.]+) .* load L0 \[([\d, ]+)\]", text)
    assert [int(s) for s, _, _ in lines] == [1, 2, 3, 4, 5], text
    assert all(sum(int(v) for v in load.split(",")) == 4 * 16 * 2 for _, _, load in lines)  # global load, top-2
    assert "summary" in text and "tokens/s" in text and "load balance" in text
    assert re.search(r"optimizer +[\d.]+ MiB of AdamW state \(bfloat16 moments\) on rank 0, sharded over the ranks",
                     text), text
    assert re.search(r"parameters +[\d.]+ MiB on rank 0 between steps, its ranges", text), text
    grads = re.search(r"gradients +[\d.]+ MiB on rank 0 between steps, its ranges \(parallel.shard_gradients; peak "
                      r"in flight ([\d.]+) MiB\)", text)
    assert grads and float(grads.group(1)) > 0, text
    assert "exported" in text and (tmp_path / "hf" / "model.safetensors").exists()  # gathered whole to export
    meta = json.loads((out / "checkpoint" / "moecompile.json").read_text())
    assert meta["step"] == 5 and meta["ep"] == 2 and meta["world_size"] == 2
    assert (out / "plan.yaml").exists()
    # the ep=2 checkpoint (ZeRO-3) resumes in one process (ep=1): two more steps, from step 5
    # ... as 2 micro-batches of 2 sequences a step (the graph traced at 2, gradients accumulated), compiled
    proc = moecompile("train", "--steps", "7", *FAST, "--out", str(out), "--resume", "--nproc", "1",
                      "--micro-batch", "2", "--adam-moments", "bf16", "--compile", cwd=tmp_path)
    assert "micro-batches of 2 per rank; forward under torch.compile" in proc.stdout and re.search(r"steps +2 \(now at step 7\)", proc.stdout), \
        proc.stdout
    assert [int(s) for s in re.findall(r"step +(\d+) +loss", proc.stdout)] == [6, 7]
    assert re.search(r"tokens/s \([\d,]+ after the first step, which compiled the forward in \d+ s\)", proc.stdout)
    assert json.loads((out / "checkpoint" / "moecompile.json").read_text())["step"] == 7


@pytest.mark.distributed
@pytest.mark.parametrize("name, experts, arch", [("tiny-mixtral", "4 experts top-2", "mixtral"),
                                                 ("tiny-deepseek-v3", "8 experts top-2 within 2 of 4 groups",
                                                  "deepseek_v3")])
def test_an_moe_model_trains_with_its_own_experts_and_continues_from_its_hf_export(tmp_path, name, experts, arch):
    fast = ["--batch", "4", "--seq", "16", "--log-every", "1", "--schedule", "constant"]
    proc = moecompile("train", "--model", name, "--steps", "4", *fast, "--out", str(tmp_path / "a"),
                      "--export-hf", str(tmp_path / "hf"), cwd=tmp_path)
    assert f"{name} its own MoE layers: {experts}," in proc.stdout and f"({arch})" in proc.stdout, proc.stdout
    first = [float(v) for v in re.findall(r"step +\d+ +loss ([\d.]+)", proc.stdout)]
    proc = moecompile("train", "--model", str(tmp_path / "hf"), "--steps", "1", "--nproc", "1", *fast,
                      "--out", str(tmp_path / "b"), cwd=tmp_path)
    assert f"(weights loaded) its own MoE layers: {experts}," in proc.stdout, proc.stdout
    again = float(re.search(r"step +1 +loss ([\d.]+)", proc.stdout).group(1))
    assert again < first[0] - 0.05, (first, again)  # the same first batch, on the trained weights


def test_a_bad_plan_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moecompile", "train", "--nproc", "1", "--steps", "1",
                           "--set", "experts.top_k=9", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "experts.top_k" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_micro_batch_that_does_not_divide_the_rank_batch_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moecompile", "train", "--nproc", "1", "--steps", "1", *FAST,
                           "--micro-batch", "3", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--micro-batch 3 must divide the 4 sequences" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--set", "parallel.ep=4"], "'parallel.ep' = 4: must divide the world size 2"),
    (["--set", "parallel.etp=3"], "times parallel.etp=3 (3 ranks hold one layer's expert slices) must divide"),
    (["--set", "recompute.modules=moe"], "must be list (a list is written [moe]"),
    (["--batch", "7"], "--batch 7 must be a multiple of the 2 ranks"),
    (["--model", "tiny-phi3", "--export-hf", "hf"], "no Hugging Face MoE architecture takes a 'phi3' model"),
    (["--set", "experts.shared_experts=1", "--export-hf", "hf"], "cannot export as mixtral: the plan has 1 shared"),
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device"),
])
def test_what_the_arguments_decide_fails_once_before_any_rank_starts(tmp_path, capsys, monkeypatch, args, words):
    """Two ranks asked for: the plan, the batch split and the export target are checked in the launcher, one
    message and status 2, no rank spawned (each would print it, and a bad export would fail after training)."""
    from moecompile import cli
    from moecompile.commands import train

    monkeypatch.setattr(train, "_spawn", lambda args: pytest.fail("spawned ranks for arguments that cannot run"))
    assert cli.main(["train", "--nproc", "2", "--steps", "1", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("moecompile train:") == 1, err


@pytest.mark.parametrize("sets, ep", [([], 4), (["parallel.etp=2"], 2), (["parallel.etp=4"], 1),
                                      (["parallel.etp=2", "parallel.ep=1"], 1)])
def test_ep_defaults_to_the_ranks_etp_leaves(tmp_path, sets, ep):
    from moecompile.cli import build_parser
    from moecompile.commands.train import preflight

    args = build_parser().parse_args(["train", "--nproc", "4", "--out", str(tmp_path),
                                      *[a for s in sets for a in ("--set", s)]])
    assert preflight(args, 4).plan.parallel.ep == ep


@pytest.mark.parametrize("choice, gpus, env, want", [
    ("auto", 0, {}, "cpu"),
    ("auto", 2, {}, "cuda:1"),  # spawned rank 1 of 2 (its LOCAL_RANK) on its own GPU
    ("auto", 1, {}, "cpu"),  # two ranks, one GPU: NCCL takes one rank per GPU
    ("auto", 8, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, "cuda:3"),  # torchrun's environment
    ("cpu", 2, {}, "cpu"),
    ("cuda", 1, {}, "launch at most 1 (--nproc 1"),
])
def test_the_device_is_a_gpu_per_local_rank_or_the_cpu(monkeypatch, choice, gpus, env, want):
    """On a GPU machine `moecompile train` used to stay on the CPU and still pick NCCL (which refuses CPU tensors)."""
    import torch

    from moecompile.devices import resolve_device
    from moecompile.errors import MoecompileError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if want.startswith(("cpu", "cuda:")):
        assert str(resolve_device(choice, rank=1, world_size=2)) == want
    else:
        with pytest.raises(MoecompileError, match=re.escape(want)):
            resolve_device(choice, rank=1, world_size=2)


def test_the_lr_schedule_warms_up_decays_and_resumes_where_it_stopped():
    import argparse

    import torch

    from moecompile.commands.train import lr_factor, lr_scheduler

    args = argparse.Namespace(lr=1e-2, schedule="cosine", warmup=None, steps=50, min_lr=0.1)
    factors = [lr_factor(i, "cosine", 5, 50, 0.1) for i in range(50)]
    assert factors[:5] == [0.2, 0.4, 0.6, 0.8, 1.0] and factors[5] == 1.0
    assert factors[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(factors[5:], factors[6:]))
    assert {lr_factor(i, "constant", 5, 50, 0.1) for i in range(5, 50)} == {1.0}

    def opt():
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)

    straight = opt()
    s = lr_scheduler(straight, args, 0)
    lrs = []
    for _ in range(30):
        lrs.append(straight.param_groups[0]["lr"])
        straight.step()  # no gradients: nothing moves, but the scheduler sees the optimizer stepped
        s.step()
    resumed = opt()  # a checkpoint after 20 steps: the schedule picks up at step 20
    lr_scheduler(resumed, args, 20)
    assert resumed.param_groups[0]["lr"] == pytest.approx(lrs[20])
    assert lrs[0] == pytest.approx(args.lr * 0.2)  # default warm-up: a tenth of 50 steps = 5
