"""The MoE op vocabulary: `torch.ops.moecompile.<op>` with fake impls and autograd.

    logits_TE ─route─▶ weights_TK, idx_TK
    x_TH ─permute─▶ x_NH ─grouped_mm─▶ glu ─grouped_mm─▶ y_NH ─unpermute─▶ out_TH

Also `moecompile::grouped_mm_wgrad`, the weight gradient grouped_mm's backward calls,
and the other backward passes as ops of their own (route_backward,
permute_backward, unpermute_backward, glu_backward), so a traced backward
holds one node per kernel. Options: `permute(..., align=a)` pads each expert's
group to a multiple of a rows; `glu(h, act, weight_N)` multiplies each row's
routing weight in (then combine with unpermute(..., weighted=False)), and
`glu(h, act, weight_N, weight_input=True)` scales the rows by it before the
activation, as experts whose input rows were weighted compute (Llama 4).

FP8 (forward-only building blocks for the FP8 pass; recipes and scale layouts
in kernels/fp8_quantize.py and kernels/grouped_mm_fp8.py):

    quantize_fp8(x, recipe: str, fmt: str, block: int) -> (q, scale)
        recipe "tensorwise" | "rowwise" | "tile" (1 x block) | "block" (block x block),
        fmt "e4m3" | "e5m2"; scale float32 in the layout torch._scaled_mm takes.
    grouped_mm_fp8(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe: str, block: int,
                   bias_EO: Tensor?, out_dtype: dtype) -> y_NO
        recipe "tensorwise" | "rowwise" | "blockwise" (x "tile", w "block").

Importing this package registers every op. Each op has its `<op>_ref` (pure
torch: the CPU path and the test oracle) and a Triton body in
`<op>_triton.py`; the op's body asks `backend.implementation(...)` which one
runs (CUDA -> Triton, CPU -> reference, `MOECOMPILE_KERNELS=triton|reference`
or `backend.use(...)` forces one), so call sites never branch on what is installed.
"""
if __name__ == "moecompile.kernels":
    from . import async_a2a, backend  # noqa: F401  (async_a2a: moecompile::a2a_start / a2a_wait)
    from .adamw import adamw_update, adamw_update_ref
    from .ep_ops import pack_row_weights, sort_chunks, sort_chunks_ref, unpack_row_weights
    from .fp8_quantize import dequantize_fp8, quantize_fp8, quantize_fp8_ref
    from .glu import glu, glu_ref
    from .grouped_mm import grouped_mm, grouped_mm_ref
    from .grouped_mm_fp8 import grouped_mm_fp8, grouped_mm_fp8_ref
    from .permute import permute, permute_ref
    from .route import route, route_ref
    from .unpermute import row_weights, unpermute, unpermute_ref
else:
    # Run from the repository root (python -m pytest puts it on sys.path), this folder shadows any
    # top-level package named `kernels`: transformers probes for Hugging Face's `kernels` and would
    # import this one, defining every op a second time. So under any name but moecompile.kernels
    # it hands over to the real package when one is installed (the import statement returns what
    # sys.modules holds once this file has run), and is otherwise an empty shell without __file__,
    # which is how transformers' probe recognises a shadowing folder rather than a real install.
    def _hand_over() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec(__name__, path)
        if spec is not None and spec.loader is not None:
            real = importlib.util.module_from_spec(spec)
            sys.modules[__name__] = real
            spec.loader.exec_module(real)

    _hand_over()
    __file__ = None  # type: ignore[assignment]

__all__ = [
    "backend",
    "dequantize_fp8",
    "glu",
    "glu_ref",
    "grouped_mm",
    "grouped_mm_ref",
    "grouped_mm_fp8",
    "grouped_mm_fp8_ref",
    "permute",
    "permute_ref",
    "quantize_fp8",
    "quantize_fp8_ref",
    "route",
    "route_ref",
    "sort_chunks",
    "sort_chunks_ref",
    "pack_row_weights",
    "unpack_row_weights",
    "row_weights",
    "unpermute",
    "unpermute_ref",
]
