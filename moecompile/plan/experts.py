"""Plan section ``experts``: which FFNs become MoE layers and how they route."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal, Union

from .section import Section, doc_field


@dataclasses.dataclass(frozen=True)
class ExpertsConfig(Section):
    name = "experts"

    num_experts: int = doc_field(8, "E, routed experts per MoE layer.")
    top_k: int = doc_field(2, "k, experts each token is sent to.")
    granularity: int = doc_field(
        1,
        "G: each dense FFN is split into G slices along its intermediate dimension "
        "(fine-grained experts of size F/G); E and k must be multiples of G.",
    )
    shared_experts: int = doc_field(
        0, "Always-on experts, each a full-width copy of the dense FFN, run beside the routed ones."
    )
    layers: Union[str, list] = doc_field(
        "all", "'all', 'every:N' (FFN 0, N, 2N, ...), or a list of module paths / regexes (full match)."
    )
    adopt: bool = doc_field(
        True, "Adopt the MoE layers the model already has (Mixtral, Qwen3-MoE...: pass import_moe; the fields "
        "above must then describe them). false leaves them as the model's own code and upcycles dense FFNs only."
    )
    score: Literal["softmax", "sigmoid"] = doc_field("softmax", "Router score function.")
    normalize: bool = doc_field(True, "Renormalise the top-k weights to sum to 1 (needed for exact upcycling).")
    route_groups: int = doc_field(
        1, "Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups, each scored by "
        "the sum of its two best choice scores, and a token picks its top-k among its route_group_top_k best "
        "groups only. 1: no groups."
    )
    route_group_top_k: int = doc_field(1, "Groups each token may pick from (DeepSeek-V3's topk_group).")
    router_dtype: Literal["model", "float32"] = doc_field(
        "model", "Dtype of the router GEMM and its scores. 'float32' computes the logits in fp32 in a bf16 model, "
        "so near-ties route stably (DeepSeek-V3's router, Megatron-Core's moe_router_dtype)."
    )
    route_scale: float = doc_field(
        1.0, "Multiplies every routing weight after any renormalisation (DeepSeek-V3's routed_scaling_factor); "
        "1 keeps exact upcycling."
    )
    apply_weights: Literal["auto", "activation", "combine"] = doc_field(
        "auto",
        "Where each routed row's weight is multiplied in. 'combine': on the expert outputs [T*k, H] as the "
        "combine sums them (Hugging Face's order; the combine keeps those rows for its backward). "
        "'activation': on the GLU output [T*k, F], before the down projection (Megatron-Core's probs in the "
        "activation): nothing [T*k, H] is kept for the combine's backward and the multiply and its gradient "
        "dot are F wide, not H; needs GLU experts without an output bias (the weight must commute with the "
        "down projection). 'auto': activation where it applies, else combine. Under the alltoall dispatcher at "
        "ep > 1 the planner prices both (combine sends no weights with the rows).",
    )
    capacity_factor: Union[float, None] = doc_field(
        None, "Per-expert capacity as a multiple of T*k/E; null is dropless."
    )
    drop_policy: Literal["probs", "position"] = doc_field(
        "probs", "Which tokens an expert over capacity keeps: highest weight, or earliest position."
    )
    aux_loss: Literal["none", "aux", "seq_aux", "global_aux"] = doc_field(
        "none", "Load-balancing loss: Switch-style over this rank's batch (aux), DeepSeek's per sequence "
        "(seq_aux), or Switch-style with the expert load counted over the global batch (global_aux: one "
        "E-element all-reduce per layer over the data-parallel ranks, so ep or dp > 1 trains exactly like one "
        "process on the whole batch; Megatron-Core's global_aux_loss)."
    )
    aux_loss_coeff: float = doc_field(0.01, "Weight of the load-balancing loss.")
    z_loss_coeff: float = doc_field(0.0, "Weight of the router z-loss (mean squared logsumexp of logits).")
    expert_bias: bool = doc_field(
        False, "Aux-loss-free balancing: a per-expert bias added to the scores for selection only."
    )
    expert_bias_rate: float = doc_field(
        1e-3, "Bias update per step (DeepSeek-V3's gamma): b_e += rate * sign(mean load - load_e)."
    )
    seed: int = doc_field(0, "Seed of the router initialisation (with the layer name; the same on every rank).")
    router_noise: float = doc_field(
        0.0, "Std of noise added to upcycled router rows so experts can diverge; 0 keeps exact equivalence."
    )

    def validate(self) -> None:
        E, k, G = self.num_experts, self.top_k, self.granularity
        if E < 1:
            self.fail("num_experts", "must be >= 1")
        if k < 1 or k > E:
            self.fail("top_k", f"must be between 1 and num_experts ({E})")
        if G < 1:
            self.fail("granularity", "must be >= 1")
        if E % G:
            self.fail("num_experts", f"must be a multiple of granularity ({G}): each dense FFN yields G slices")
        if k % G:
            self.fail("top_k", f"must be a multiple of granularity ({G}) so a token can take whole FFN copies")
        if self.shared_experts < 0:
            self.fail("shared_experts", "must be >= 0")
        groups, group_k = self.route_groups, self.route_group_top_k
        if groups < 1 or E % groups:
            self.fail("route_groups", f"must be >= 1 and divide num_experts ({E}) into equal groups")
        if not 1 <= group_k <= groups:
            self.fail("route_group_top_k", f"must be between 1 and route_groups ({groups})")
        if k > group_k * (E // groups):
            self.fail("top_k", f"must be at most the {group_k * (E // groups)} experts in route_group_top_k "
                      f"({group_k}) groups of {E // groups}")
        if not self.route_scale > 0:
            self.fail("route_scale", "must be > 0")
        for coeff in ("aux_loss_coeff", "z_loss_coeff", "router_noise", "expert_bias_rate"):
            if getattr(self, coeff) < 0:
                self.fail(coeff, "must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            self.fail("capacity_factor", "must be > 0, or null for dropless")
        if self.expert_bias and not self.normalize and self.score == "softmax":
            self.fail(
                "expert_bias",
                "expert_bias with softmax scores needs normalize=true (the bias shifts selection only; "
                "unnormalised softmax weights then no longer sum to one)",
            )
        self._check_layers()

    def _check_layers(self) -> None:
        layers = self.layers
        if isinstance(layers, str):
            if layers == "all":
                return
            m = re.fullmatch(r"every:(\d+)", layers)
            if not m or int(m.group(1)) < 1:
                self.fail("layers", "must be 'all', 'every:N' with N >= 1, or a list of module paths / regexes")
            return
        for pattern in layers:
            if not isinstance(pattern, str):
                self.fail("layers", f"list entries must be strings, got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                self.fail("layers", f"entry {pattern!r} is not a valid regex ({e})")

    def selects(self, index: int, module_path: str) -> bool:
        """Whether the FFN number ``index`` (in graph order) at ``module_path`` is converted."""
        if self.layers == "all":
            return True
        if isinstance(self.layers, str):
            return index % int(self.layers.split(":")[1]) == 0
        return any(re.fullmatch(p, module_path) for p in self.layers)

    def capacity(self, num_tokens: int) -> int:
        """Rows per expert in capacity mode (0 = dropless)."""
        if self.capacity_factor is None:
            return 0
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))
