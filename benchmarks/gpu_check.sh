#!/usr/bin/env bash
# Every check that needs a GPU, in one run of at most 9.5 minutes on one H100/H200 (issue #4's open part):
# fits one device `run` (600 s a command) with its limits below.
#
#     bash benchmarks/gpu_check.sh            # writes logs and JSON to $OUT, else out/gpu_check
#
# Each step has its own time limit and the script goes on past a failure; the last lines say which
# steps passed. The lent machines' image has its own torch (2.11 when last read) and Triton, with
# nothing to fetch: the package is installed without dependencies or build isolation, over what is
# there, and imported from the working tree where that install fails.
set -u
out="${OUT:-out/gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
declare -A status

step() {  # step NAME SECONDS COMMAND...: run it with a limit, keep its log, record pass/fail
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    status[$name]="rc=$rc in $((SECONDS - start)) s"
}

nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1; then
    # no build tools there (an old setuptools without `wheel` cannot build an editable): lay passes/ and
    # kernels/ inside the package by links, as pyproject's package-dir does, so it imports from the root
    tail -n 5 "$out/install.log"
    ln -sfn ../passes moecompile/passes && ln -sfn ../kernels moecompile/kernels
    echo "not installed; importing moecompile from $PWD (passes/ and kernels/ linked into it)"
fi
python3 -m moecompile env  # versions, the GPU, FP8, kernels and collectives here, and any problem found
python3 -m moecompile env --json > "$out/env.json"

# first, whether this torch imports and converts at all: a tiny model converted on the GPU, one forward in
# fp32 and one under bf16 autocast (the default on CUDA; torch 2.11's export broke it until stop 36)
step smoke 40 python3 -c "import torch, moecompile as mc; from moecompile.models import build_model
m, (ids,) = build_model('tiny-llama'); ids = ids.cuda()
r = mc.convert(m.cuda(), {'experts': {'num_experts': 4, 'top_k': 2}}, (ids,)); print(r.module(ids).logits.shape)
with torch.autocast('cuda', torch.bfloat16): print(r.module(ids).logits.dtype)"
# the CUDA-graph runners (partial and full capture) and the offloaded optimizer on CUDA, against eager
step pytest_gpu 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graphs.py tests/test_optimizer_offload.py
# FP8 GEMMs on CUDA (cuBLAS _scaled_mm for dense layers, the Triton FP8 kernel for experts) against the CPU's oracles
step fp8 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8.py
# each Triton kernel against its torch reference and the copy / cuBLAS limits (also checks their results)
step kernels 100 python3 benchmarks/kernels_gpu.py --shapes qwen3-30b --json "$out/kernels.json"
# the main job on the GPU: bf16 autocast, Triton kernels, the optimizer step; loss must fall
step train 100 python3 -m moecompile train --device cuda --nproc 1 --steps 40 --log-every 10 --out "$out/train"
# moecompile against Hugging Face's own Mixtral on the same weights, eager and under torch.compile
step bench 130 python3 -m moecompile bench --device cuda --model small-llama --steps 5 --warmup 2 \
    --variants moecompile,moecompile_compiled,hf_grouped_mm --json "$out/bench.json"

echo "=== summary"
for name in smoke pytest_gpu fp8 kernels train bench; do
    echo "$name: ${status[$name]:-not run}"
done
