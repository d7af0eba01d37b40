"""The overlap pass: legal schedules, the pipeline it builds, and unchanged numerics over gloo.

Oracle for numerics: the same plan with overlap off, on the same ranks and batch. Chunking only
regroups rows, so outputs and the expert load are equal and gradients agree to float summation
order (TOL, relative to the largest entry). The scheduler and the legality check are tested on
hand-built graphs; the distributed scenarios spawn real processes (tests/_dist.py).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import moecompile as mc
from moecompile import schedule
from moecompile.passes.overlap_auto import LayerCosts, choose

import _overlap_scenario as sc
from _dist import spawn

TOL = 1e-5
aten, fc = torch.ops.aten, torch.ops._c10d_functional


# ---------------------------------------------------------------- plan


def test_plan_section_defaults_round_trip_and_rules():
    p = mc.Plan.from_dict({"overlap": {"enabled": True, "chunks": 3}})
    assert (p.overlap.chunks, p.overlap.shared_expert, p.overlap.backward) == (3, True, True)
    assert mc.Plan.from_dict(p.to_dict()) == p and mc.Plan().overlap.chunks == "auto"
    for bad in (0, 65, "x", True, 2.0):
        with pytest.raises(mc.PlanError, match="overlap.chunks"):
            mc.Plan.from_dict({"overlap": {"chunks": bad}})
    static_allgather = {"ep": 2, "dispatcher": "allgather", "dispatch_mode": "static", "capacity_factor": 1.0}
    with pytest.raises(mc.PlanError, match="would change which tokens are dropped"):
        mc.Plan.from_dict({"experts": {"num_experts": 4}, "parallel": static_allgather,
                           "overlap": {"enabled": True, "chunks": 2}})
    mc.Plan.from_dict({"experts": {"num_experts": 4}, "parallel": static_allgather, "overlap": {"enabled": True, "chunks": 1}})


def test_ep1_is_a_recorded_no_op():
    torch.manual_seed(0)
    x = torch.randn(2, 4, sc.H)
    on = mc.convert(sc.Stack(), sc.plan(1, {"chunks": 2}), (x,))
    off = mc.convert(sc.Stack(), sc.plan(1), (x,))
    rec = on.record("overlap")
    assert not rec.changed and "no exchanges to overlap" in rec.decisions[0]
    assert on.module.code == off.module.code


# ---------------------------------------------------------------- scheduler and legality on hand-built graphs


def _graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """x -> a2a start -> wait -> mm(., w) ; relu(x) independent ; add."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    s = g.call_function(fc.all_to_all_single.default, (x, [4, 4], [4, 4], "g"))
    wt = g.call_function(torch.ops.moecompile.wait_tensor.default, (s, "dispatch", "g"))
    mm = g.call_function(aten.mm.default, (wt, w))
    r = g.call_function(aten.relu.default, (x,))
    out = g.call_function(aten.add.Tensor, (mm, r))
    g.output(out)
    return g, {"x": x, "start": s, "wait": wt, "mm": mm, "relu": r, "add": out}


def test_list_schedule_hoists_the_start_and_sinks_the_wait_behind_independent_compute():
    g, n = _graph()
    window = [m for m in g.nodes if m.op == "call_function"]
    prio = {n["start"]: 0, n["wait"]: 3}
    order = schedule.list_schedule(schedule.dependency_graph(g), window, lambda m: prio.get(m, 2))
    schedule.reorder(g, window, order)
    nodes = list(g.nodes)
    assert nodes.index(n["start"]) < nodes.index(n["relu"]) < nodes.index(n["wait"]) < nodes.index(n["mm"])
    assert schedule.check_schedule(g) == []
    pairs = schedule.collective_pairs(g)
    assert pairs == [(n["start"], n["wait"])] and schedule.between(g, *pairs[0]) == [n["relu"]]


def test_check_schedule_catches_a_read_before_the_wait_and_a_broken_order():
    g, n = _graph()
    with g.inserting_after(n["start"]):
        early = g.call_function(aten.add.Tensor, (n["start"], 1))  # reads the in-flight buffer
    n["add"].replace_input_with(n["relu"], early)
    problems = schedule.check_schedule(g)
    assert any(f"used before its wait by {early.name}" in p for p in problems), problems
    g2, n2 = _graph()
    n2["wait"].prepend(n2["mm"])  # the matmul now runs before the wait it reads
    assert any(f"{n2['mm'].name} uses {n2['wait'].name} before it is computed" in p for p in schedule.check_schedule(g2))
    g3, n3 = _graph()
    n3["mm"].update_arg(0, n3["x"])
    n3["wait"].update_arg(0, n3["relu"])
    assert any("not a collective start" in p for p in schedule.check_schedule(g3))


def test_the_overlap_verifier_rejects_an_illegal_graph():
    from moecompile.passes.overlap import verify_schedule

    g, n = _graph()
    with g.inserting_after(n["start"]):
        g.call_function(operator.getitem, (n["start"], 0))
    gm = fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(AssertionError, match="used before its wait"):
        verify_schedule(gm, None)  # type: ignore[arg-type]


def test_dependencies_keep_random_ops_in_order_and_respect_grad_mode_barriers():
    g = fx.Graph()
    x = g.placeholder("x")
    r1 = g.call_function(aten.rand_like.default, (x,))
    off = g.call_function(torch._C._set_grad_enabled, (False,))
    r2 = g.call_function(aten.rand_like.default, (x,))
    late = g.call_function(aten.relu.default, (x,))
    g.output((r1, r2, late, off))
    dag = schedule.dependency_graph(g)
    assert dag.has_edge(r1, off) and dag.has_edge(off, r2) and dag.has_edge(off, late)
    window = [r1, off, r2, late]
    order = schedule.list_schedule(dag, window, lambda m: {late: 0, r2: 0}.get(m, 1))
    assert order.index(r1) < order.index(off) < order.index(r2) and order.index(off) < order.index(late)


# ---------------------------------------------------------------- the auto cost model


def test_cost_model_replays_the_pipeline_and_picks_n():
    compute_bound = LayerCosts(rows=1024, payload_bytes=1 << 20, exchanges=1, x0_s=1e-5, x1_s=1e-5,
                               latency_s=1e-5, s_per_byte=1e-10)
    t1, c1 = compute_bound.simulate(1)
    d = c = 1e-5 + (1 << 20) * 1e-10
    assert t1 == pytest.approx(d + c1 + c) and c1 == pytest.approx(1e-5 + 1024e-5)
    balanced = LayerCosts(rows=1024, payload_bytes=1 << 20, exchanges=1, x0_s=1e-5, x1_s=2e-6,
                          latency_s=2e-5, s_per_byte=1.25e-9)
    n, why = choose(balanced, 8)
    assert n > 1 and balanced.simulate(n)[0] < 0.8 * balanced.simulate(1)[0], why
    assert f"N={n}" in why and "exposed comm" in why
    latency_bound = LayerCosts(rows=64, payload_bytes=4096, exchanges=2, x0_s=1e-4, x1_s=1e-8,
                               latency_s=5e-4, s_per_byte=1e-10)
    assert choose(latency_bound, 8)[0] == 1


# ---------------------------------------------------------------- over gloo


EP2_CASES = [
    ("dropless/off", sc.plan(2)),
    ("dropless/N=1", sc.plan(2, {"chunks": 1})),
    ("dropless/N=2", sc.plan(2, {"chunks": 2})),
    ("dropless/N=3", sc.plan(2, {"chunks": 3, "shared_expert": False})),
    ("dropless/N=2 unpacked", sc.plan(2, {"chunks": 2}, pack=False)),  # the weights' own exchanges, chunked
    ("dropless/auto", sc.plan(2, {"chunks": "auto"})),
    ("static/off", sc.plan(2, mode="static")),
    ("static/N=2", sc.plan(2, {"chunks": 2}, mode="static")),
    ("static/N=2 unpacked", sc.plan(2, {"chunks": 2}, mode="static", pack=False)),
]
EP4_CASES = [
    ("dropless/off", sc.plan(4)),
    ("dropless/N=2", sc.plan(4, {"chunks": 2})),
    ("dropless/auto", sc.plan(4, {"chunks": "auto"})),
]


@pytest.fixture(scope="module")
def ep2() -> list[dict]:
    return spawn(sc.scenario, 2, args=(EP2_CASES, True), timeout=240)


def _assert_same_numerics(reports: list[dict], cases: list) -> None:
    for report in reports:
        for name, _p in cases:
            d = report[name]["diff"]
            assert report[name]["legal"] == [], (name, report[name]["legal"])
            assert d["same_params"] and d["load"] == 0, (name, d)
            assert max(d["y"], d["x_grad"], d["grads"]) <= TOL, (name, d)


@pytest.mark.distributed
def test_ep2_outputs_grads_and_load_match_the_serial_graph(ep2):
    _assert_same_numerics(ep2, EP2_CASES)


@pytest.mark.distributed
def test_ep2_chunks_pack_the_routing_weights_per_chunk_unless_the_plan_says_not(ep2):
    packs = {name: ep2[0][name]["packs"] for name, _p in EP2_CASES}
    assert packs["dropless/N=2"] == packs["static/N=2"] == 2 * 2, packs  # 2 layers x 2 chunks
    assert packs["dropless/N=2 unpacked"] == packs["static/N=2 unpacked"] == 0, packs


@pytest.mark.distributed
def test_ep2_training_curve_is_unchanged(ep2):
    for report in ep2:
        off, on = report["train"]["dropless/off"], report["train"]["dropless/N=1"]
        assert on == pytest.approx(off, rel=TOL), (off, on)


@pytest.mark.distributed
def test_ep2_record_shows_the_pipeline(ep2):
    rec = ep2[0]["dropless/N=2"]
    sched = rec["data"]["schedule"]
    assert rec["data"]["chunks"] == {"layers.0": 2, "layers.1": 2}
    for layer in ("layers.0", "layers.1"):
        by = {(c["chunk"], c["what"]): c["overlaps"] for c in sched[layer]["collectives"]}
        assert "experts(chunk 0)" in by[(1, "dispatch")] and "shared_experts" in by[(0, "dispatch")]
        assert "experts(chunk 1)" in by[(0, "combine")]
        tl = sched[layer]["timeline"]
        assert tl.index("start dispatch(chunk 1)") < tl.index("experts(chunk 0)") < tl.index("wait combine(chunk 0)")
    assert "layers.0 chunk 1 dispatch overlaps" in "\n".join(rec["decisions"])
    no_shared = ep2[0]["dropless/N=3"]["data"]["schedule"]["layers.0"]["collectives"]
    assert all("shared_experts" not in c["overlaps"] for c in no_shared if c["what"] == "dispatch")
    static = ep2[0]["static/N=2"]["data"]["schedule"]["layers.0"]
    assert static["chunks"] == 2 and any("experts(chunk 0)" in c["overlaps"] for c in static["collectives"])


@pytest.mark.distributed
def test_ep2_auto_picks_the_same_n_on_every_rank_and_says_why(ep2):
    chosen = [r["dropless/auto"]["data"]["chunks"] for r in ep2]
    assert chosen[0] == chosen[1]
    assert all("auto: experts" in r["dropless/auto"]["data"]["schedule"]["layers.0"]["why"] for r in ep2)


def _run_in_flight(ops: list[str]) -> list[str]:
    """The ops that ran while at least one all-to-all was started and not yet waited for."""
    out, pending = [], 0
    for op in ops:
        if op == "all_to_all_single":
            pending += 1
        elif op == "wait_tensor":
            pending -= 1
        elif pending:
            out.append(op)
    return out


@pytest.mark.distributed
def test_ep2_backward_exchanges_overlap_expert_compute(ep2):
    assert _run_in_flight(ep2[0]["dropless/off"]["backward_ops"]) == []  # torch's backward waits at once
    hidden = _run_in_flight(ep2[0]["dropless/N=2"]["backward_ops"])
    assert hidden.count("grouped_mm_wgrad") >= 4 and "mm" in hidden, hidden  # experts and shared experts


@pytest.fixture(scope="module")
def ep4() -> list[dict]:
    return spawn(sc.scenario, 4, args=(EP4_CASES, False, 1), timeout=300)  # one layer: 4 ranks share the cores


@pytest.mark.distributed
def test_ep4_outputs_grads_and_load_match_the_serial_graph(ep4):
    _assert_same_numerics(ep4, EP4_CASES)
    assert len({str(r["dropless/auto"]["data"]["chunks"]) for r in ep4}) == 1


@pytest.mark.distributed
@pytest.mark.slow
def test_ep4_allgather_and_static_with_overlap():
    cases = [
        ("allgather/off", sc.plan(4, dispatcher="allgather")),
        ("allgather/N=3", sc.plan(4, {"chunks": 3}, dispatcher="allgather")),
        ("static/off", sc.plan(4, mode="static")),
        ("static/N=3", sc.plan(4, {"chunks": 3, "backward": False}, mode="static")),
        ("sallgather/off", sc.plan(4, mode="static", dispatcher="allgather")),
        ("sallgather/N=1", sc.plan(4, {"chunks": 1}, mode="static", dispatcher="allgather")),
    ]
    reports = spawn(sc.scenario, 4, args=(cases,), timeout=600)
    _assert_same_numerics(reports, cases)
    assert reports[0]["allgather/N=3"]["data"]["chunks"] == {"layers.0": 3, "layers.1": 3}
