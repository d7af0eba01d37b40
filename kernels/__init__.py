"""The MoE op vocabulary: `torch.ops.moecompile.<op>` with fake impls and autograd.

    logits_TE ─route─▶ weights_TK, idx_TK
    x_TH ─permute─▶ x_NH ─grouped_mm─▶ glu ─grouped_mm─▶ y_NH ─unpermute─▶ out_TH

Also `moecompile::grouped_mm_wgrad`, the weight gradient grouped_mm's backward calls.

Importing this package registers every op. Each op's device-generic
implementation is its `<op>_ref` (pure torch: the CPU path and the test
oracle); a faster per-device kernel (Triton) registers beside it with
`torch.library.register_kernel("moecompile::<op>", "cuda", ...)`, so call
sites never branch on what is installed.
"""
from .glu import glu, glu_ref
from .grouped_mm import grouped_mm, grouped_mm_ref
from .permute import permute, permute_ref
from .route import route, route_ref
from .unpermute import unpermute, unpermute_ref

__all__ = [
    "glu",
    "glu_ref",
    "grouped_mm",
    "grouped_mm_ref",
    "permute",
    "permute_ref",
    "route",
    "route_ref",
    "unpermute",
    "unpermute_ref",
]
