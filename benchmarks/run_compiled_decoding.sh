#!/usr/bin/env bash
# Compiled decoding: every kind's step eager and through torch.compile (`mgk bench decode --compile`,
# kinds alternating round by round in one process per cell), whole models at batch 1 with WikiText-103's vocabulary
# and with 32,000 words, then one layer and lm-small at batches 1 and 8; the tables of BENCHMARKS.md come from
# benchmarks/compiled_decode_table.py. Quiet machine (nothing else running), 2 threads.
set -euo pipefail
out=benchmarks/results
kinds=softmax:8,mgk:4,smgk:4,gqa+num_kv_heads=2:8
run=${RUN:-1}
python -m mgk bench decode --same-process --compile --targets lm-small,wt103-paper --kinds $kinds \
    --contexts 256,1024 --batches 1 --steps 24 --rounds 5 --json "$out/decode_compiled_B1_final_run$run.json"
python -m mgk bench decode --same-process --compile --targets lm-small,wt103-paper --kinds $kinds \
    --contexts 256,1024 --batches 1 --steps 24 --rounds 5 --set vocab_size=32000 \
    --json "$out/decode_compiled_B1_V32k_final_run$run.json"
python -m mgk bench decode --same-process --compile --targets layer,lm-small --kinds $kinds \
    --contexts 256,4096 --batches 1,8 --steps 16 --rounds 5 --json "$out/decode_compiled_layer_B8_final_run$run.json"
python benchmarks/compiled_decode_table.py "$out/decode_compiled_B1_final_run$run.json"
