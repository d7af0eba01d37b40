#!/usr/bin/env bash
# The test suite against another torch release, in a venv of its own: the lent GPUs' image has torch 2.11
# and Triton 3.6, outside pyproject's range, and nothing can be fetched there, so check it here first.
#
#     bash benchmarks/torch_compat.sh 2.11.0 [pytest arguments]     # default: -m "not slow"
#
# pip takes that release's default build (from PyPI: a CUDA build, about 5 GB with its libraries; it runs
# on the CPU) with the Triton it pins, and the other dependencies and test extras from pyproject.toml;
# moecompile goes in without dependencies, over that torch. The venv is kept ($VENV) for the next run.
# On 2.11.0 (2026-12-07) what failed was torch's or the environment's, not moecompile's: CPU _scaled_mm
# there takes only tensorwise scales (the rowwise / blockwise FP8 tests), its fake process group leaves
# outputs unwritten (test_memory's sharded estimates read garbage sizes), and Triton 3.6's interpreter
# cannot take NumPy 2.5's arrays as scalars (the TRITON_INTERPRET suite; an ad hoc cross-compile built all 19
# kernels for sm_90 with Triton 3.6, all fitting).
set -eu
version=$1
shift
venv="${VENV:-/tmp/moecompile-torch-$version}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    others=$(python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']
print(' '.join(r for r in p['dependencies'] + p['optional-dependencies']['test'] if not r.startswith(('torch', 'triton'))))")
    # shellcheck disable=SC2086  # one argument per requirement
    "$venv/bin/pip" install -q "torch==$version" wheel $others
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ $# -eq 0 ]; then
    set -- -m "not slow"
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
