#!/usr/bin/env bash
# The commands behind BENCHMARKS.md (CPU). Run from the repository root on a quiet machine.
set -euo pipefail
out=benchmarks/results
mkdir -p "$out"
kinds=softmax:8,mgk:4,smgk:4,mgk-sdpa:4,mgk-hard:4,mgk-softe:4,linear:8,mlk:4,reference:4
mgk bench attention --lengths 4096 --kinds "$kinds" --backward --repeats 5 --json "$out/cpu_4096_fwd_bwd.json"
mgk bench attention --lengths 4096 --kinds "$kinds" --backward --causal --repeats 5 \
    --json "$out/cpu_4096_fwd_bwd_causal.json"
mgk bench attention --lengths 256,1024,4096,8192 --kinds softmax:8,mgk:4,mgk-sdpa:4,linear:8,mlk:4 --repeats 5 \
    --json "$out/cpu_lengths_fwd.json"
mgk bench model --task listops --json "$out/cpu_model_listops_small.json"
mgk bench attention --lengths 256,1024,4096,8192 --batch 1 --embed-dim 256 --head-dim 32 \
    --kinds softmax:8,mgk:4,smgk:4,mgk-hard:4,mgk-softe:4,linear:8,mlk:4 --json "$out/cpu_issue_command_fwd.json"
