"""The pass manager: ordering, records, user passes, and failures named where they happen."""

import runpy
import pathlib

import pytest
import torch
import torch.fx as fx

import moecompile as mc
from moecompile.pass_manager import PIPELINE, resolve_order

PLAN = {"experts": {"num_experts": 4, "top_k": 2}}


def test_history_records_every_pass(llama, ids):
    result = mc.convert(llama, PLAN, (ids,))
    assert [r.name for r in result.history][:4] == ["trace", "import_moe", "find_ffn", "upcycle"]
    assert not result.record("import_moe").data["layers"]  # a dense model: nothing to adopt
    up = result.record("upcycle")
    assert up.num_nodes > result.record("find_ffn").num_nodes
    assert up.num_params > result.record("trace").num_params
    assert "torch.ops.moecompile.route.default" in up.code
    assert up.op_counts["moecompile.grouped_mm.default"] == 4  # two GEMMs in each of two layers
    assert any("model.layers.1.mlp" in d for d in up.decisions)
    report = result.report()
    assert "find_ffn" in report and "upcycle" in report and "8 experts" not in report
    assert "4 experts top-2" in report


def test_user_pass_by_function_and_by_name_with_ordering(llama, ids):
    seen = []

    def count_routes(gm: fx.GraphModule, ctx: mc.PassContext):
        seen.append(sum(n.target == torch.ops.moecompile.route.default for n in gm.graph.nodes))
        ctx.decide(f"{seen[-1]} routers")

    mc.register_pass("before_upcycle", lambda gm, ctx: seen.append("before"), before="upcycle", after="find_ffn")
    result = mc.convert(llama, PLAN, (ids,), passes=[count_routes, "before_upcycle"])
    names = [r.name for r in result.history]
    assert names.index("find_ffn") < names.index("before_upcycle") < names.index("upcycle") < names.index("count_routes")
    assert seen == ["before", 2]
    assert result.record("count_routes").decisions == ["2 routers"]


def test_a_pass_spec_runs_where_its_constraints_put_it_without_being_registered(llama, ids):
    seen = []
    spec = mc.PassSpec("one_conversions_pass", lambda gm, ctx: seen.append(ctx.passes_run[-1]), after=("upcycle",),
                       before=("expert_parallel",), requires=("moe",))
    result = mc.convert(llama, PLAN, (ids,), passes=[spec])
    names = [r.name for r in result.history]
    assert names.index("upcycle") + 1 == names.index("one_conversions_pass") < names.index("expert_parallel")
    assert seen == ["upcycle"] and "one_conversions_pass" not in mc.registered_passes()


def test_unknown_pass_name_lists_registered_ones():
    with pytest.raises(mc.PassError, match=r"registered: (\w+, )*expert_parallel, find_ffn, fp8, import_moe, "):
        resolve_order(["no_such_pass"])


def test_cycle_in_constraints_is_reported():
    mc.register_pass("cyc_a", lambda gm, ctx: None, after="cyc_b")
    mc.register_pass("cyc_b", lambda gm, ctx: None, after="cyc_a")
    with pytest.raises(mc.PassError, match="cycle"):
        resolve_order(["cyc_a", "cyc_b"])


def test_pass_that_breaks_the_graph_is_named(llama, ids):
    def break_shapes(gm, ctx):
        node = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
        with gm.graph.inserting_after(node):
            bad = gm.graph.call_function(torch.ops.aten.mm.default, (node, node))  # [.., 32] @ [.., 32]: bad
        node.replace_all_uses_with(bad, delete_user_cb=lambda u: u is not bad)

    with pytest.raises(mc.PassError) as err:
        mc.convert(llama, PLAN, (ids,), passes=[break_shapes])
    assert err.value.pass_name == "break_shapes"
    assert "upcycle" in err.value.ran_before and "shape propagation failed" in str(err.value)
    assert err.value.node and "aten.mm" in err.value.node


def test_pass_that_raises_is_wrapped_and_chained(llama, ids):
    def explode(gm, ctx):
        raise RuntimeError("boom")

    with pytest.raises(mc.PassError, match="pass 'explode' failed .*RuntimeError: boom") as err:
        mc.convert(llama, PLAN, (ids,), passes=[explode])
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_pass_that_changed_nothing_keeps_its_shapes_and_one_that_says_so_falsely_is_named(llama, ids, monkeypatch):
    from torch.fx.passes.infra.pass_base import PassResult

    import moecompile.pass_manager as pm

    propagated = []
    real = pm.propagate_fake
    monkeypatch.setattr(pm, "propagate_fake", lambda gm, inputs: (propagated.append(len(gm.graph.nodes)),
                                                                 real(gm, inputs)))
    result = mc.convert(llama, PLAN, (ids,), passes=[lambda gm, ctx: PassResult(gm, False)])
    unchanged = [r.name for r in result.history[1:] if not r.changed]
    assert "<lambda>" in unchanged and "import_moe" in unchanged  # a dense model: nothing to adopt
    assert len(propagated) == len(result.history) - 1 - len(unchanged)
    assert all("val" in n.meta for n in result.module.graph.nodes if n.op == "call_function")

    def claims_no_change(gm, ctx):
        node = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
        with gm.graph.inserting_after(node):
            twice = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 2.0))
        node.replace_all_uses_with(twice, delete_user_cb=lambda u: u is not twice)
        return PassResult(gm, False)

    with pytest.raises(mc.PassError, match=r"PassResult\(modified=False\) but changed the graph") as err:
        mc.convert(llama, PLAN, (ids,), passes=[claims_no_change])
    assert err.value.pass_name == "claims_no_change"


def test_missing_requirement_is_reported(llama, ids):
    mc.register_pass("needs_magic", lambda gm, ctx: None, after="upcycle", requires=("magic",))
    with pytest.raises(mc.PassError, match=r"needs \['magic'\]"):
        mc.convert(llama, PLAN, (ids,), passes=["needs_magic"])


def test_verifier_runs_after_its_pass_and_every_later_one(llama, ids):
    calls = []
    mc.register_verifier("upcycle", lambda gm, ctx: calls.append(len(ctx.history)))
    try:
        result = mc.convert(llama, PLAN, (ids,), passes=[lambda gm, ctx: None])
    finally:
        from moecompile.pass_manager import _VERIFIERS

        _VERIFIERS["upcycle"].pop()
    names = [r.name for r in result.history]
    assert len(calls) == len(names) - names.index("upcycle")  # after upcycle and every pass after it


def test_dump_dir_gets_the_code_after_every_pass(llama, ids, tmp_path):
    mc.convert(llama, PLAN, (ids,), options=mc.Options(dump_dir=tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[:4] == ["00_trace.py", "01_import_moe.py", "02_find_ffn.py", "03_upcycle.py"]
    assert len(files) == len(mc.convert(llama, PLAN, (ids,)).history)
    assert "moecompile.permute" in (tmp_path / "03_upcycle.py").read_text()


def test_builtin_pipeline_is_one_ordered_list():
    assert PIPELINE[:3] == ["import_moe", "find_ffn", "upcycle"]


def test_custom_pass_example_runs(capsys):
    runpy.run_path(str(pathlib.Path(__file__).parent.parent / "examples" / "custom_pass.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "router_entropy" in out and "router entropy" in out and "nats" in out
