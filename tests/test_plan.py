import json

import pytest

import moecompile as mc
from moecompile import Plan, PlanError


def test_defaults_and_round_trip_yaml(tmp_path):
    plan = Plan.from_dict({"experts": {"num_experts": 16, "top_k": 4, "granularity": 2, "layers": "every:2",
                                       "aux_loss": "seq_aux", "z_loss_coeff": 1e-3, "capacity_factor": 1.25}})
    path = tmp_path / "new" / "dir" / "plan.yaml"  # save makes the directories
    plan.save(path)
    again = Plan.from_file(path)
    assert again == plan
    assert again.experts.num_experts == 16 and again.experts.layers == "every:2"


def test_round_trip_json(tmp_path):
    plan = Plan.from_dict({"experts": {"layers": ["model\\.layers\\.[01]\\.mlp"]}})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["experts"]["layers"] == ["model\\.layers\\.[01]\\.mlp"]
    assert Plan.from_file(path) == plan
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize(
    "fields, field, words",
    [
        ({"num_experts": 4, "top_k": 5}, "experts.top_k", "between 1 and num_experts"),
        ({"num_experts": 6, "top_k": 2, "granularity": 4}, "experts.num_experts", "multiple of granularity"),
        ({"num_experts": 8, "top_k": 3, "granularity": 2}, "experts.top_k", "multiple of granularity"),
        ({"aux_loss_coeff": -0.1}, "experts.aux_loss_coeff", ">= 0"),
        ({"z_loss_coeff": -1.0}, "experts.z_loss_coeff", ">= 0"),
        ({"router_noise": -1.0}, "experts.router_noise", ">= 0"),
        ({"shared_experts": -1}, "experts.shared_experts", ">= 0"),
        ({"capacity_factor": 0}, "experts.capacity_factor", "> 0"),
        ({"score": "tanh"}, "experts.score", "'softmax' | 'sigmoid'"),
        ({"layers": "every:0"}, "experts.layers", "every:N"),
        ({"layers": ["("]}, "experts.layers", "not a valid regex"),
        ({"expert_bias": True, "normalize": False}, "experts.expert_bias", "normalize=true"),
        ({"num_experts": 8, "route_groups": 3}, "experts.route_groups", "divide num_experts (8)"),
        ({"num_experts": 8, "route_groups": 4, "route_group_top_k": 5}, "experts.route_group_top_k", "between 1 and"),
        ({"num_experts": 8, "top_k": 3, "route_groups": 4, "route_group_top_k": 1}, "experts.top_k",
         "at most the 2 experts"),
        ({"route_scale": 0.0}, "experts.route_scale", "> 0"),
        ({"top_k": "2"}, "experts.top_k", "must be int"),
        ({"layers": 3}, "experts.layers", "must be str | list (a list is written [3], in YAML as in --set)"),
        ({"capacity_factor": "x"}, "experts.capacity_factor", "must be float | null"),
        ({"num_expert": 8}, "experts.num_expert", "valid keys are num_experts"),
    ],
)
def test_invalid_plans_name_field_value_and_rule(fields, field, words):
    with pytest.raises(PlanError) as err:
        Plan.from_dict({"experts": fields})
    assert err.value.field == field
    assert words in str(err.value)


def test_unknown_section_lists_valid_ones():
    with pytest.raises(PlanError, match="unknown plan section; valid sections are experts"):
        Plan.from_dict({"expert": {}})


def test_plan_error_is_a_moecompile_error():
    assert issubclass(PlanError, mc.MoecompileError) and issubclass(PlanError, ValueError)


def test_layer_selection():
    cfg = Plan.from_dict({"experts": {"layers": "every:2"}}).experts
    assert [cfg.selects(i, f"l{i}") for i in range(4)] == [True, False, True, False]
    cfg = Plan.from_dict({"experts": {"layers": [r"model\.layers\.1\.mlp"]}}).experts
    assert cfg.selects(0, "model.layers.1.mlp") and not cfg.selects(1, "model.layers.11.mlp")


def test_describe_documents_every_field():
    rows = Plan.describe()
    assert all(doc for _, _, doc in rows)
    assert ("experts.top_k", "2") == rows[1][:2]
