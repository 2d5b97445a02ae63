"""The authors' protocol (Nguyen et al. 2022; released code github.com/minhtannguyen/transformer-mgk, traced in
docs/authors-protocol.md) as preset values shared by the ``*-paper`` presets, each with its source.

Sources: ``lra/X`` = ``lra/X.py`` of the authors' repository; ``LM/X`` = ``language-modeling/lmtool-fwms/src/X``;
"Nystromformer cfg" = github.com/mlpen/Nystromformer ``LRA/code/lra_config.py`` (the code base the paper says its LRA
runs follow; the authors' repository does not set these per task).

The dicts are keyed by ``--set`` names. ``AUTHORS_LRA_FORMS`` and ``AUTHORS_LM_FORMS`` hold the authors' attention
form of each kind, as option values per kind: a ``*-paper`` preset keeps them as its ``attention_forms``
(:func:`mgk.config.with_forms`), so the kind a run chooses (``--attention mlk``) gets its own form and the others'
values never reach it.
"""
from __future__ import annotations

import math

__all__ = ["AUTHORS_LRA", "AUTHORS_LM", "AUTHORS_LRA_FORMS", "AUTHORS_LM_FORMS", "LRA_TASKS"]

# The LRA model and training code, common to every task.
AUTHORS_LRA = dict(
    d_model=64, ffn_dim=128, head_dim=32, num_layers=2,  # lra/run_tasks.py:53-79 defaults; Nystromformer cfg
    dropout=0.1, attn_dropout=0.1,  # lra/run_tasks.py:53-79 (dropout, attention dropout 0.1)
    pooling="mean",  # lra/model_wrapper.py:11 (MEAN; ours over real tokens only, see docs/paper-protocol.md)
    classifier_dim=128, classifier_activation="relu",  # lra/model_wrapper.py:35-39 Linear(64,128)-ReLU-Linear
    attn_bias=True,  # lra/attention.py:256-258, 289, 291 (projections with bias)
    init="paper",  # lra/model.py:20-24 (word and position embeddings from N(0, 0.02); the rest torch defaults)
    weight_decay=0.0, adam_eps=1e-6,  # lra/run_tasks.py:196-200, defaults :74-75 (AdamW betas 0.9, 0.999)
    schedule="onecycle",  # lra/run_tasks.py:202-208 (OneCycleLR, pct_start warmup/steps, linear), :260-261
    precision="fp16",  # lra/run_tasks.py:158, 210; lra/model_wrapper.py:64 (autocast + GradScaler; attention fp32)
)

# Per task: Nystromformer cfg (batch, lr, warm-up, steps, eval_frequency / num_eval_steps), except Retrieval's batch
# 24 and warm-up 8000 from the authors' lra/README.md commands. Dev batches have the training batch size
# (lra/run_tasks.py:190-192), so eval_batch_size = batch_size: added below.
LRA_TASKS = {
    "listops": dict(max_len=2000, batch_size=32, lr=1e-4, warmup_steps=1000, steps=5000, eval_every=50,
                    eval_batches=62),  # Nystromformer cfg "listops"
    "text": dict(max_len=1000, batch_size=32, lr=1e-4, warmup_steps=8000, steps=20000, eval_every=500,
                 eval_batches=781),  # Nystromformer cfg "text"; lra/run_tasks.py:53-79 defaults
    "retrieval": dict(max_len=4000, batch_size=24, lr=1e-4, warmup_steps=8000, steps=30000, eval_every=300,
                      eval_batches=565),  # lra/README.md commands (batch 24, warm-up 8000); cfg "retrieval"
    "image": dict(max_len=1024, batch_size=256, lr=1e-4, warmup_steps=175, steps=35000, eval_every=175,
                  eval_batches=20),  # Nystromformer cfg "image"
    "pathfinder": dict(max_len=1024, batch_size=256, lr=1e-4, warmup_steps=312, steps=62400, eval_every=312,
                       eval_batches=312),  # Nystromformer cfg "pathfinder32"
}
for _values in LRA_TASKS.values():
    _values["eval_batch_size"] = _values["batch_size"]

# The WikiText-103 LM (LM/ = language-modeling/lmtool-fwms/src; README = its README commands).
AUTHORS_LM = dict(
    task="lm", segment_len=256, max_len=256,  # README: tgt_len 256, mem_len 0, eval_tgt_len 256
    d_model=128, num_layers=16, ffn_dim=2048, head_dim=16,  # README; FFN LM/mem_transformer.py:46-79
    dropout=0.1, attn_dropout=0.0,  # README: dropout 0.1, dropatt 0.0
    attn_bias=False,  # LM/mem_transformer.py:92-104 (q_net, kv_net, o_net without bias)
    adaptive_softmax="authors",  # LM/utils/proj_adaptive_softmax.py:22-47 (tied table, bias, clusters, div_val 1)
    adaptive_cutoffs=None,  # LM/train.py: cutoffs [20000, 40000, 200000] (None = these)
    init="paper",  # LM/train.py weights_init, --init normal --init_std 0.02
    batch_size=96, lr=2.5e-4, weight_decay=0.0, adam_eps=1e-8,  # README; LM/train.py (Adam, default eps)
    warmup_steps=2000, schedule="cosine_global", steps=500_000,  # LM/train.py --scheduler cosine, max_step 500000
    grad_clip=0.25,  # README --clip 0.25
    precision="32",  # README commands run without --fp16
    eval_every=4000, eval_batch_size=10, eval_batches=0,  # LM/train.py --eval-interval 4000, eval batch 10, full
    seed=1111,  # LM/train.py --seed default
)

# LRA, MGK and MLK: one (2,) mixture weight per layer shared by heads and positions, not normalised over the
# components (lra/attention.py:124, 222-223; attention_linear.py:21, 46), without the clamp (free log-weights).
_LRA_MIXTURE = dict(pi_shape="layer", pi_norm="none")
# LRA linear attention: no denominator, features scaled by L^(-1/4) (lra/attention_linear.py:57-64).
_LRA_LINEAR = dict(normalize="length", feature_map="elu")
AUTHORS_LRA_FORMS = {
    "mgk": _LRA_MIXTURE, "smgk": _LRA_MIXTURE,  # lra/attention.py:124, 222-223 (the shifted keys share the form)
    "linear": _LRA_LINEAR,  # lra/attention_linear.py:57-64
    "mlk": {**_LRA_MIXTURE, **_LRA_LINEAR, "mix": "keys"},  # MLK mixes raw keys: lra/attention_linear.py:38-40
    "smlk": {**_LRA_MIXTURE, **_LRA_LINEAR, "mix": "keys"},  # lra/attention_linear.py:38-40
}

_SQRT_D = math.sqrt(16)  # LM head_dim 16
# LM MGK (attn_type 200, rbf2keys): sigma^2 = (sqrt(D), sqrt(D)/3) LM/mem_transformer.py:108, 150-151; per-head,
# per-position pi not normalised over components :119-120, 198.
_LM_MIXTURE = dict(pi_shape="position", pi_norm="none")
# LM linear / MLK (types 34, 400): elu+1 divided by its sum, output times 1/sqrt(D), row denominator plus 1e-5
# (cfwl; LM/mem_transformer.py:443, 498-540).
_LM_LINEAR = dict(normalize="row", feature_map="elu_sum", output_scale=1 / _SQRT_D, eps=1e-5, eps_mode="add")
AUTHORS_LM_FORMS = {
    "mgk": {**_LM_MIXTURE, "sigma2": (_SQRT_D, _SQRT_D / 3)},  # LM/mem_transformer.py:108, 150-151
    "smgk": {**_LM_MIXTURE, "sigma2": (_SQRT_D, _SQRT_D / 3)},  # LM/mem_transformer.py:108, 150-151
    "linear": _LM_LINEAR,  # attn_type 34, LM/mem_transformer.py:443
    "mlk": {**_LM_MIXTURE, **_LM_LINEAR, "mix": "features"},  # attn_type 400, LM/mem_transformer.py:405-542
    "smlk": {**_LM_MIXTURE, **_LM_LINEAR, "mix": "features"},  # LM/mem_transformer.py:405-542
}
