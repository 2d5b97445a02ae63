#!/usr/bin/env bash
# The throughput and memory tables of BENCHMARKS.md (CPU, float32): whole-model training/inference throughput and
# memory side by side,
# and the attention-layer ratios at N=4096 (forward + backward). Run from the repository root on a quiet machine:
#   benchmarks/run_throughput_tables.sh            # the real settings (tens of minutes)
#   QUICK=1 benchmarks/run_throughput_tables.sh    # tiny settings: checks that every command runs (not for numbers)
set -euo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
if [[ "${QUICK:-0}" == "1" ]]; then
    model_set=(--set max_len=64 --set batch_size=2); steps=1; n4k=256; n1k=128; b1k=2; repeats=1
else
    model_set=(); steps=3; n4k=4096; n1k=1024; b1k=8; repeats=5
fi
kinds=softmax:8,mgk:4

# ListOps at the paper's length (2000 tokens) and batch (32): with the preset's attention dropout 0.1 and without.
mgk bench model --preset listops-paper --kinds "$kinds" --steps "$steps" "${model_set[@]}" \
    --json "$out/model_listops_paper_dropout.json"
mgk bench model --preset listops-paper --kinds "$kinds" --steps "$steps" "${model_set[@]}" --set attn_dropout=0 \
    --json "$out/model_listops_paper_no_dropout.json"
# Text at 4000 bytes; the other paper-length LRA presets and the LM preset for the whole-model table.
for preset in text-4k text-paper retrieval-paper wt103-paper; do
    mgk bench model --preset "$preset" --kinds "$kinds" --steps "$steps" "${model_set[@]}" \
        --json "$out/model_${preset//-/_}.json"
done
# One attention layer, N=4096 forward + backward: Hard-E against the sum mixture, Soft-E (training) against learned pi.
mgk bench attention --lengths "$n4k" --backward --repeats "$repeats" \
    --kinds softmax:8,mgk:4,mgk-hard:4,mgk-softe:4,smgk:4,mgk-sdpa:4 --json "$out/attention_4096_fwd_bwd.json"
# The stretch: MGK-4 against softmax-8 at N=1024, batch 8, forward + backward.
mgk bench attention --lengths "$n1k" --batch "$b1k" --backward --repeats "$repeats" --kinds "$kinds" \
    --json "$out/attention_1024_b8_fwd_bwd.json"
# The fixed per-call cost at 256 tokens (forward only, as in BENCHMARKS.md).
mgk bench attention --lengths 256 --repeats "$repeats" --kinds "$kinds" --json "$out/attention_256_fwd.json"
