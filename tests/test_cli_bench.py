"""``moecompile bench``: every variant trains the same function on the same tokens (timings are not asserted)."""

from __future__ import annotations

import json

import pytest

from moecompile.cli import main


@pytest.mark.distributed
def test_bench_variants_train_the_same_model(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny-llama", "--batch", "4", "--seq", "8", "--steps", "2", "--warmup", "0",
            "--nproc", "2", "--threads", "2", "--variants", "dense,moecompile,hf_grouped_mm", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["dense", "moecompile", "hf_grouped_mm", "moecompile_ep2"]
    for name, r in rows.items():
        assert name in text and len(r["losses"]) == 2 and r["ms"] > 0 and r["tokens_per_s"] > 0
    mc, hf, ep2 = rows["moecompile"]["losses"], rows["hf_grouped_mm"]["losses"], rows["moecompile_ep2"]["losses"]
    assert mc[0] == pytest.approx(rows["dense"]["losses"][0], rel=1e-6)  # upcycled at init = dense
    assert mc == pytest.approx(hf, rel=1e-5)  # HF's Mixtral from the export trains the same way
    assert mc == pytest.approx(ep2, rel=1e-5)  # as does ep = 2 on half the batch per rank
    assert "vs HF: tokens/s over the fastest Hugging Face MoE (hf_grouped_mm)" in text
    assert "round(s) of fresh processes, on cpu" in text and {r["device"] for r in rows.values()} == {"cpu"}


@pytest.mark.parametrize("argv, message", [
    (["--variants", "moecompile,megatron"], "unknown bench variant 'megatron'"),
    (["--variants", "moecompile_compiled_ep0"], "unknown bench variant 'moecompile_compiled_ep0'"),
    (["--variants", "moecompile_compiled_ep3"], "does not split over 3 ranks"),
    (["--nproc", "3"], "does not split over 3 ranks"),
    (["--set", "parallel.ep=2"], "leave parallel.ep at 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device"),
])
def test_bench_errors_name_the_fix(argv, message, capsys):
    assert main(["bench", "--model", "tiny-llama", "--batch", "4", *argv]) == 2
    assert message in capsys.readouterr().err
