#!/usr/bin/env bash
# The GPU check, one script of under 8 minutes on one GPU (the steps' limits add up to 460 s): the Triton kernel tests compiled (no interpreter), the
# CUDA paths of every attention kind with cached decoding and generation (tests/test_cuda_paths.py), then
# `mgk bench attention` and `mgk bench decode` on CUDA. Logs, JUnit XML and JSON go to $OUT (default
# benchmarks/results/gpu-<date>), with gpu_check.json summing up each step's exit status and seconds.
# Until this has passed on a GPU, the Triton path stays opt-in (MGK_TRITON=1; README "Use the attention").
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#   OUT=/some/folder bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET   # compiled kernels, not the interpreter
export MGK_TRITON=1      # MGK takes the Triton kernels on CUDA where they serve

# Fail loudly and early: no CUDA device, or no Triton, means nothing below would test the GPU paths.
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: CUDA is not available here (torch.cuda.is_available() is False); run this on a GPU machine" >&2
    exit 2
fi
if ! python -c "import triton" 2>/dev/null; then
    echo "gpu_check: Triton is not importable (pip install -e '.[gpu]'); the Triton kernels cannot be checked" >&2
    exit 2
fi
python -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" \
    | tee "$OUT/device.txt"

STATUS=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, record the exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - t0)) s; tail of $OUT/$name.log:"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
    STATUS+=("\"$name\": {\"exit\": $rc, \"seconds\": $((SECONDS - t0))}")
}

step triton_kernels 120 python -m pytest -q -p no:cacheprovider tests/functional/test_mixture_triton.py \
    tests/functional/test_triton_dropout.py --junitxml="$OUT/triton_kernels.xml"
step cuda_paths 90 python -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py \
    --junitxml="$OUT/cuda_paths.xml"
step bench_attention 80 python -m mgk bench attention --device cuda --lengths 1024,4096 --batch 8 \
    --kinds softmax:8,mgk:4,smgk:4,mgk-sdpa:4,linear:8,mlk:4 --repeats 5 --json "$OUT/attention_cuda.json"
step bench_decode 170 python -m mgk bench decode --device cuda --targets layer,wt103-paper --batches 8 \
    --contexts 256,4096 --steps 16 --json "$OUT/decode_cuda.json"

printf '{%s}\n' "$(IFS=,; echo "${STATUS[*]}")" >"$OUT/gpu_check.json"
echo "gpu_check: summary in $OUT/gpu_check.json"
if grep -q '"exit": [1-9]' "$OUT/gpu_check.json"; then
    echo "gpu_check: FAILED (see the logs in $OUT)" >&2
    exit 1
fi
echo "gpu_check: passed"
