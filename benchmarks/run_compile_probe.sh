#!/usr/bin/env bash
# The compile probe of BENCHMARKS.md ("Would compiling the decoding step pay on CPU?"), twice. Quiet machine.
set -euo pipefail
out=benchmarks/results
for run in 1 2; do
    python benchmarks/compile_probe.py --context 256 --batch 1 --threads 2 --json "$out/compile_probe_b1_256_run$run.json"
    python benchmarks/compile_probe.py --context 1024 --batch 1 --threads 2 --json "$out/compile_probe_b1_1024_run$run.json"
    python benchmarks/compile_probe.py --context 256 --batch 1 --threads 2 --layers 16 \
        --json "$out/compile_probe_b1_256_16layers_run$run.json"
    python benchmarks/compile_probe.py --context 256 --batch 1 --threads 2 --vocab 256 \
        --json "$out/compile_probe_b1_256_vocab256_run$run.json"
    python benchmarks/compile_probe.py --context 4096 --batch 8 --threads 2 --json "$out/compile_probe_b8_4096_run$run.json"
done
