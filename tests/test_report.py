"""The report, costs and diff say the right things about a known conversion (tiny Llama, E=4, k=2)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

import moecompile as mc
from moecompile.costs import graph_costs, human, node_flops
from moecompile.errors import MoecompileError
from moecompile.history import PassRecord
from moecompile.models import build_model
from moecompile.report import format_value, render_report, report_rows

# tiny-llama: H=32, F=64, 4 query heads (KV 2, head 8), vocab 128, 2 layers; batch 2 x 8 tokens
H, F, KV, V, L, E, K, T = 32, 64, 16, 128, 2, 4, 2, 16
ATTN_PROJ = 2 * H * (H + KV + KV + H)  # q, k, v, o per token
SDPA = 2 * 2 * (2 * 4) * 8 * 8 * 8 // T  # QK^T and PV: 2 bmm x 2 FLOP/MAC x (B*heads) x S x S x D, per token
DENSE_FLOPS = L * (ATTN_PROJ + SDPA + 2 * 3 * H * F) + 2 * H * V
MOE_FLOPS = L * (ATTN_PROJ + SDPA + 2 * H * E + K * 2 * 3 * H * F) + 2 * H * V


@pytest.fixture(scope="module")
def result():
    model, (ids,) = build_model("tiny-llama")

    def placement(gm, ctx):  # a user pass recording decisions and structured data
        ctx.decide("placed experts 0-1 on rank 0, 2-3 on rank 1")
        ctx.record(placement={"rank0": [0, 1], "rank1": [2, 3]}, overlapped=3)

    return mc.convert(model, {"experts": {"num_experts": E, "top_k": K, "aux_loss": "aux"}}, (ids,), passes=[placement])


@pytest.fixture(scope="module")
def rows(result):
    return {r.name: r for r in report_rows(result)}


def test_flops_per_token_match_the_arithmetic(rows):
    assert rows["trace"].costs.flops_per_token == DENSE_FLOPS == 47104
    assert rows["find_ffn"].costs.flops_per_token == DENSE_FLOPS  # analysis only
    assert rows["upcycle"].costs.flops_per_token == MOE_FLOPS == 72192
    assert rows["upcycle"].costs.flops_by_role["experts"] == L * K * 2 * 3 * H * F * T
    assert rows["upcycle"].costs.flops_by_role["router"] == L * 2 * H * E * T


def test_graph_flops_agree_with_flop_counter_on_a_real_forward(result, rows):
    ids = result.example_inputs[0]
    with FlopCounterMode(display=False) as counter:
        result.module(ids)
    # torch counts no attention on CPU (its CPU kernel has no formula); everything else must agree
    assert counter.get_total_flops() == (MOE_FLOPS - L * SDPA) * T
    assert counter.get_flop_counts()["Global"][torch.ops.moecompile.grouped_mm] == L * K * 2 * 3 * H * F * T


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_gemms_count_the_flops_of_the_gemms_they_replace(recipe):
    """fp8_linear / fp8_grouped_linear are opaque custom ops: without their formulas a converted FP8 graph
    counted 0 FLOPs for every GEMM it quantized (the planner then priced FP8 plans at a fraction of their work)."""
    model, (ids,) = build_model("tiny-llama")
    experts = {"num_experts": 4, "top_k": 2}
    plain = mc.convert(model, {"experts": experts}, (ids,))
    fp8 = mc.convert(model, {"experts": experts, "fp8": {"recipe": recipe, "modules": ["experts", "attention_proj"]}},
                     (ids,))
    graph = fp8.history[-1].graph
    quantized = [n for n in graph.nodes if str(n.target) in ("moecompile.fp8_linear.default",
                                                             "moecompile.fp8_grouped_linear.default")]
    assert {str(n.target) for n in quantized} == {"moecompile.fp8_linear.default",
                                                  "moecompile.fp8_grouped_linear.default"}
    assert all(node_flops(n) > 0 for n in quantized)
    assert graph_costs(graph).flops == graph_costs(plain.history[-1].graph).flops


def test_parameters_and_nodes(result, rows):
    up = rows["upcycle"]
    assert up.params_delta == L * (E * 3 * H * F + E * H - 3 * H * F) == 37120
    assert up.params == rows["trace"].params + 37120
    before = {(n.name, str(n.target)) for n in result.record("find_ffn").graph.nodes}
    after = {(n.name, str(n.target)) for n in result.record("upcycle").graph.nodes}
    assert (up.added, up.removed) == (len(after - before), len(before - after))
    assert up.removed >= L * 5 + L * 3  # each FFN's 3 linears, silu, mul and its 3 weights went
    assert up.nodes == up_nodes(result) == rows["find_ffn"].nodes + up.added - up.removed
    assert rows["find_ffn"].added == rows["find_ffn"].removed == 0


def up_nodes(result):
    return len(result.record("upcycle").graph.nodes)


def test_activations_count_outputs_and_skip_recomputed(result):
    graph = result.record("upcycle").graph
    base = graph_costs(graph)
    assert base.activation_bytes > graph_costs(result.record("trace").graph).activation_bytes
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    node = next(n for n in copy.nodes if n.target == torch.ops.moecompile.grouped_mm.default or str(n.target) == "moecompile.grouped_mm.default")
    node.meta["moe"] = {**node.meta["moe"], "role": mc.Role.RECOMPUTE}
    marked = graph_costs(copy)
    size = node.meta["val"].numel() * 4
    assert marked.activation_bytes == base.activation_bytes - size
    assert marked.recomputed_bytes == size


def _collective_graph() -> fx.Graph:
    """x -> all_to_all -> wait -> all_gather(group of 4) -> wait, with meta["val"] set by hand."""
    f = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(16, 32)
    a2a = g.call_function(f.all_to_all_single.default, (x, [8, 8], [8, 8], "ep"))
    a2a.meta["val"] = torch.empty(16, 32)
    w1 = g.call_function(f.wait_tensor.default, (a2a,))
    w1.meta["val"] = torch.empty(16, 32)
    ag = g.call_function(f.all_gather_into_tensor.default, (w1, 4, "dp"))
    ag.meta["val"] = torch.empty(64, 32)
    w2 = g.call_function(f.wait_tensor.default, (ag,))
    w2.meta["val"] = torch.empty(64, 32)
    g.output(w2)
    return g


def test_communication_bytes_from_functional_collectives():
    c = graph_costs(_collective_graph())
    assert c.collectives == 2  # waits are not transfers
    assert c.comm_by_op == {"all_to_all_single": 16 * 32 * 4, "all_gather_into_tensor": 64 * 32 * 4}
    assert c.comm_bytes_fwd == (16 + 64) * 32 * 4 and c.comm_bytes_step == 2 * c.comm_bytes_fwd
    rec = PassRecord("expert_parallel", True, 0.01, "", 6, 0, {}, ["2 collectives"], {}, _collective_graph())
    row = render_report([rec], style="plain").splitlines()[2]
    assert row.startswith("expert_parallel") and human(2 * (16 + 64) * 32 * 4, "B", 1024) == "20.00 KiB" in row


def test_moecompile_async_exchange_counts_as_a_collective():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(16, 32)
    start = g.call_function(torch.ops.moecompile.a2a_start.default, (x, [8, 8], [8, 8], "ep"))
    start.meta["val"] = torch.empty(16, 32)
    wait = g.call_function(torch.ops.moecompile.a2a_wait.default, (start, [8, 8], [8, 8], "dispatch", "ep"))
    wait.meta["val"] = torch.empty(16, 32)
    g.output(wait)
    c = graph_costs(g)
    assert c.collectives == 1 and c.comm_by_op == {"a2a_start": 16 * 32 * 4}
    assert c.activation_bytes == 16 * 32 * 4  # the wait hands back the start's buffer: counted once


class _Region(torch.nn.Module):
    """A recompute region as passes/regions.py builds them: fx graphs inside a called module."""

    memory_region = "recompute"

    def __init__(self):
        super().__init__()

        class Part(torch.nn.Module):
            def forward(self, x, w):
                return torch.ops.aten.relu.default(torch.ops.aten.mm.default(x, w))  # ATen, as regions hold

        self.recompute = fx.symbolic_trace(Part())

    def forward(self, x, w):
        return self.recompute(x, w)


def test_costs_look_inside_called_regions():
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.region = _Region()

        def forward(self, x, w):
            return self.region(x, w) * 2

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, _Region) or super().is_leaf_module(m, name)

    model = Model()
    gm = fx.GraphModule(model, Tracer().trace(model))
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    FakeTensorProp(gm).propagate(x, w)
    FakeTensorProp(model.region.recompute).propagate(x, w)
    c = graph_costs(gm)
    assert c.flops == 2 * 4 * 8 * 16  # the matmul inside the region
    assert c.recomputed_bytes == 2 * 4 * 16 * 4  # matmul and relu outputs: recomputed in backward
    assert c.activation_bytes == 4 * 16 * 4  # only the outer mul's output is kept
    rec_subgraphs = __import__("moecompile.history", fromlist=["_subgraphs"])._subgraphs(gm)
    assert list(rec_subgraphs) == ["region"] and rec_subgraphs["region"][0] == "recompute"
    assert graph_costs(gm.graph, rec_subgraphs) == c


def test_plain_report_says_what_each_pass_did(result, rows):
    text = result.report()  # not a terminal under pytest: plain text
    assert text == render_report(result, style="plain") and "\x1b[" not in text
    lines = text.splitlines()
    assert lines[0].split() == ["pass", "nodes", "(+/-)", "params", "FLOPs/token", "activations", "comm/step", "time"]
    up = next(line for line in lines if line.startswith("upcycle "))
    u = rows["upcycle"]
    assert f"{u.nodes} (+{u.added}/-{u.removed})" in up and "63.90 K (+37.12 K)" in up and "72.19 KFLOP" in up
    assert "    - model.layers.0.mlp: glu FFN -> 4 experts top-2 (G=1, shared=0, dropless, routing weights at the activation)" in lines
    assert "    * layers: model.layers.0.mlp, model.layers.1.mlp" in lines
    assert "    - placed experts 0-1 on rank 0, 2-3 on rank 1" in lines
    assert "    * placement: rank0=0, 1; rank1=2, 3" in lines and "    * overlapped: 3" in lines
    assert "16 tokens in the example batch" in text and "FLOPs/token x1.53" in text


def test_markdown_report(result, rows):
    md = render_report(result, style="markdown")
    assert "| pass | nodes (+/-) | params | FLOPs/token | activations | comm/step | time |" in md
    table = [line for line in md.splitlines() if line.startswith("| upcycle |")]
    assert len(table) == 1 and "72.19 KFLOP" in table[0]
    section = md.split("### upcycle")[1].split("###")[0]
    assert "- model.layers.1.mlp: glu FFN -> 4 experts top-2" in section
    assert "experts 49.15 KFLOP" in section  # FLOPs/token by role


def test_rich_report_has_the_same_content(result, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # the terminal's width: a narrow one wraps the table's cells
    text = render_report(result, style="rich")
    assert "\x1b[" in text
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert "72.19 KFLOP" in plain and "placed experts 0-1 on rank 0, 2-3 on rank 1" in plain
    assert "placement: rank0=0, 1; rank1=2, 3" in plain
    with pytest.raises(MoecompileError, match="unknown report style"):
        render_report(result, style="html")


def test_format_value():
    assert format_value(torch.tensor([1, 2, 3])) == "[1, 2, 3]"
    assert format_value(torch.zeros(4, 8)) == "tensor[4, 8] float32"
    assert format_value(list(range(12))) == "0, 1, 2, 3, 4, 5, 6, 7, ... (+4 more)"
    assert format_value({"a": [1, 2], "b": 0.123456}) == "a=1, 2; b=0.1235"
    assert format_value([]) == "(none)"


# ---- diff -------------------------------------------------------------------

def test_code_diff_shows_the_ffn_replaced_by_routed_experts(result):
    text = mc.diff(result, "upcycle")
    lines = text.splitlines()
    assert lines[0] == "--- after find_ffn" and lines[1] == "+++ after upcycle"
    removed = [line for line in lines if line.startswith("-") and not line.startswith("---")]
    added = [line for line in lines if line.startswith("+") and not line.startswith("+++")]
    assert any("mlp_gate_proj_weight" in line for line in removed)
    assert sum("torch.ops.moecompile.route.default" in line for line in added) == L
    assert sum("torch.ops.moecompile.grouped_mm.default" in line for line in added) == 2 * L
    assert not any("moecompile" in line for line in removed)
    assert mc.diff(result, "find_ffn") == "# find_ffn left the generated code exactly as import_moe did"


def test_node_diff_counts_and_names_changes(result, rows):
    text = mc.diff(result, "upcycle", mode="nodes")
    up = rows["upcycle"]
    head = text.splitlines()[0]
    m = re.fullmatch(r"~ (\d+) changed, \+(\d+) added, -(\d+) removed \((\d+) -> (\d+) nodes\)", head)
    assert m and (int(m[2]), int(m[3])) == (up.added, up.removed) and int(m[5]) == up.nodes
    assert re.search(r"^\+ route = moecompile\.route\.default\(linear_\d+, None, 2, 'softmax', True\)  \(tuple of 2\)  role=route layer=model\.layers\.0\.mlp$", text, re.M)
    assert re.search(r"^\+ grouped_mm = moecompile\.grouped_mm\.default\(.*\)  \[32, 128\] float32  role=experts", text, re.M)
    assert re.search(r"^- linear_\d+ = aten\.linear\.default\(.*mlp_down_proj_weight\)  \[2, 8, 32\] float32  role=ffn", text, re.M)
    assert re.search(r"^~ add_\d+: inputs \(to_\d+, linear_\d+\) -> \(to_\d+, view_\d+\)$", text, re.M)  # residual now reads the MoE
    analysis = mc.diff(result, "find_ffn", mode="nodes")
    assert analysis.startswith("~ 10 changed, +0 added, -0 removed") and "moe.role None -> ffn" in analysis
    full = mc.diff(result, "upcycle", mode="nodes", context=1)
    assert "unchanged" not in full and len(full.splitlines()) > len(text.splitlines())


def test_result_methods(result):
    assert result.diff("upcycle", "nodes") == mc.diff(result, "upcycle", mode="nodes")
    assert result.report("markdown") == render_report(result, style="markdown")


def test_diff_errors_and_before(result):
    with pytest.raises(MoecompileError, match="no pass named 'nope' ran; ran: trace, import_moe, find_ffn, upcycle"):
        mc.diff(result, "nope")
    with pytest.raises(MoecompileError, match="nothing ran before it"):
        mc.diff(result, "trace")
    assert mc.diff(result, "upcycle", before="trace").splitlines()[0] == "--- after trace"


# ---- after expert_parallel: collectives in a real EP graph --------------------

_EP_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # 2 ranks, no real traffic
import moecompile as mc
from moecompile.models import build_model
from moecompile.report import render_report, report_rows
model, example = build_model("tiny-llama")
out = {}
for mode, cf in (("dropless", None), ("static", 2.0)):
    plan = {"experts": {"num_experts": 4, "top_k": 2}, "parallel": {"ep": 2, "dispatch_mode": mode, "capacity_factor": cf}}
    result = mc.convert(model, plan, example)
    row = next(r for r in report_rows(result) if r.name == "expert_parallel")
    line = next(l for l in render_report(result, style="plain").splitlines() if l.startswith("expert_parallel "))
    c = row.costs
    out[mode] = dict(comm=c.comm_by_op, collectives=c.collectives, flops=c.flops_per_token, estimated=c.estimated,
                     approximate=c.approximate, line=line)
print(json.dumps(out))
"""


@pytest.mark.distributed
def test_comm_bytes_and_flops_after_expert_parallel(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EP_SCRIPT], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    dense = DENSE_FLOPS - L * 2 * 3 * H * F + L * 2 * H * E  # everything but the experts, router included
    # static, capacity 16 per expert per source rank: each rank runs its 2 experts on 2 x 2 x 16 = 64 rows
    static = got["static"]
    # dispatch + combine of 64 x H rows, and the 64 rows' routing weights (the glu applies them), packed as one
    # more column of the dispatch: two collectives a layer
    assert static["comm"] == {"all_to_all_single": L * (2 * 64 * H * 4 + 64 * 4)}
    assert static["collectives"] == 2 * L and not static["estimated"] and not static["approximate"]
    assert static["flops"] == dense + L * 64 * 2 * 3 * H * F / T
    assert "65.00 KiB" in static["line"] and "~" not in static["line"]
    # dropless: counts exchange + dispatch of the 32 rows sent; what arrives is data-dependent, estimated as 32
    dropless = got["dropless"]
    assert dropless["comm"] == {"all_to_all_single": L * (E * 8 + 2 * 32 * H * 4 + 32 * 4)}
    assert dropless["collectives"] == 3 * L and dropless["estimated"] and not dropless["approximate"]
    assert dropless["flops"] == MOE_FLOPS
    assert "~72.19 KFLOP" in dropless["line"] and "~32.62 KiB" in dropless["line"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "alltoall_dedup"])
def test_recomputed_experts_at_ep_above_1_are_counted_whole(dispatcher):
    """A recompute region around the experts holds no permute: the rows they receive (a size only the count
    exchange knows) come from the graph around it. Once its grouped GEMMs counted 0 FLOPs at ep > 1 (every
    dispatcher), and under alltoall_dedup ``report()`` raised GuardOnDataDependentSymNode counting tokens."""
    from _dist import fake_rank

    with fake_rank(0, 4, ep_step=True):
        dense, (ids,) = build_model("tiny-llama", batch_size=1, seq_len=16)
        plan = {"experts": {"num_experts": 4, "top_k": 1}, "parallel": {"ep": 4, "dispatcher": dispatcher},
                "recompute": {"modules": ["moe_act"]}}
        result = mc.convert(dense, plan, (ids,))
        assert "recompute" in result.report()
        before, after = result.record("expert_parallel"), graph_costs(result.module)
        assert after.flops == graph_costs(before.graph, before.subgraphs).flops > 0 and not after.approximate
