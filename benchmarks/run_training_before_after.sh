#!/usr/bin/env bash
# Training at 256 tokens: the layer before (BEFORE=<export of the previous commit>) and after, with one
# harness (benchmarks/paired_layer.py), twice; `mgk bench attention --same-process` at the two shapes; the
# wt103-paper whole-model step. Quiet machine (nothing else running), 2 threads.
set -euo pipefail
out=benchmarks/results
before=${BEFORE:?set BEFORE to an export of the commit before the change (its src/ is used)}
for run in 1 2; do
    for pass in "" "--backward"; do
        tag=$([ -z "$pass" ] && echo fwd || echo bwd)
        PYTHONPATH=$before/src python benchmarks/paired_layer.py $pass > "$out/layer256_${tag}_before_run$run.json"
        PYTHONPATH=src python benchmarks/paired_layer.py $pass > "$out/layer256_${tag}_after_run$run.json"
    done
    python -m mgk bench attention --same-process --rounds 7 --repeats 9 --lengths 256 --batch 1 --embed-dim 256 \
        --head-dim 32 --causal --kinds softmax:8,mgk:4,smgk:4 --backward --json "$out/attention_256_causal_bwd_same_process_run$run.json"
    python -m mgk bench attention --same-process --rounds 7 --repeats 3 --lengths 256 --batch 24 --embed-dim 128 \
        --head-dim 16 --causal --kinds softmax:8,mgk:4,smgk:4 --backward --json "$out/attention_wt103_layer_bwd_same_process_run$run.json"
done
python -m mgk bench model --preset wt103-paper --kinds softmax:8,mgk:4 --set grad_accum=4 --steps 2 \
    --json "$out/model_wt103_paper_accum4_fused.json"
