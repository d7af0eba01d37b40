#!/usr/bin/env bash
# The test suite against another torch release in pyproject's range (2.11 to 2.14), in a venv of its own:
# CI runs 2.13 only, and the lent GPUs' image has torch 2.11 and Triton 3.6 with nothing to fetch there.
#
#     bash benchmarks/torch_compat.sh 2.11.0 [pytest arguments]     # default: -m "not slow"
#
# pip takes that release's default build (from PyPI: a CUDA build, about 5 GB with its libraries; it runs
# on the CPU) with the Triton it pins, and the other dependencies and test extras from pyproject.toml;
# moecompile goes in without dependencies, over that torch. The venv is kept ($VENV) for the next run.
# Triton before 3.7 interprets kernels (TRITON_INTERPRET=1) with 1-element NumPy arrays as loop bounds,
# which NumPy 2.4 no longer turns into ints: such a venv gets NumPy < 2.4.
# Results (2026-12-07): 2.14.1 and 2.12.1 pass. 2.11.0, run in a venv like the device image's (transformers
# 5.17, NumPy 2.4.6, before this script pinned NumPy): 860 passed, 7 failed, all the environment's: six
# test_report checks (transformers 5.17's rotary embedding has 4 more FLOPs a token) and the interpreter
# suite (NumPy 2.4). Those 7 were rerun and passed with transformers 5.25 and NumPy 2.3.5 (not the whole
# suite again). Under 2.11 and 2.12 the tests that run an expert-parallel step in torch's fake process
# group skip (its all-to-all leaves the outputs unwritten), and under 2.11 the CPU _scaled_mm oracle of
# rowwise scales.
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
    if "$venv/bin/python" -c "import sys, triton; sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) >= (3, 7))"; then
        "$venv/bin/pip" install -q "numpy<2.4"
    fi
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ $# -eq 0 ]; then
    set -- -m "not slow"
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
