"""Word-level language modelling on WikiText-103 (Nguyen et al. 2022, Section 4.2; Merity et al. 2017): data, the
standard LM batching, loss, perplexity.

Batching (the iterator of Transformer-XL / pytorch ``word_language_model``): the train token stream is cut into
``batch_size`` contiguous streams (the last ``T mod batch_size`` tokens are dropped); each stream into segments of
``segment_len`` input tokens whose targets are the same tokens shifted by one; step s reads segment ``s mod n`` of
every stream (n full segments per stream; the stream's last partial segment is not trained on). An example index is
``stream * n + segment``; the sampler returns the indices of step s in stream order, so the training loop's rank r
takes streams ``r * B/W .. (r+1) * B/W - 1``: disjoint slices of one global batch, and W processes see what one
process sees. Evaluation splits are one stream cut into consecutive segments (the last one shorter), so every token
after the first is predicted exactly once, from the tokens before it in its segment.

Without ``--data`` a small synthetic corpus in the WikiText layout is generated into ``<run>/data`` (``gen_train``,
``gen_val``, ``gen_test`` are its line counts); it exercises the pipeline, it is not a benchmark.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import RunConfig, lm_config, run_config, with_forms
from ..data import wikitext as wt
from ..data.tokenizers import WordTokenizer
from ..models import IGNORE_INDEX, LMConfig, TransformerLM
from ..models.adaptive import resolve_cutoffs
from .authors import AUTHORS_LM, AUTHORS_LM_FORMS
from .base import Task

# The paper's optimiser runs (IDSIA/lmtool-fwp, the code behind Schlag et al. 2021 that the paper's LM experiments
# follow: example_scripts/2021_linear_transformers_are_secretly_fwps/small_standard_transformer_baseline.sh) use
# --max_step 500000, --dropatt 0.0, Adam with its default eps 1e-8, --div_val 1 (full-width clusters).
_PAPER = {"task": "lm", "segment_len": 256, "max_len": 256, "d_model": 128, "num_layers": 16, "ffn_dim": 2048,
          "head_dim": 16, "dropout": 0.1, "attn_dropout": 0.0, "batch_size": 96, "lr": 2.5e-4, "weight_decay": 0.0,
          "adam_eps": 1e-8, "warmup_steps": 2000, "schedule": "cosine", "grad_clip": 0.25}

PRESETS = {
    # Paper, keeping the authors' values (Nguyen et al. 2022, Section 4.2; their lmtool-fwms code, each value's
    # source in mgk.tasks.authors.AUTHORS_LM): the model above with no attention-projection biases, the authors'
    # adaptive softmax (tied table, per-word and cluster biases, no projections: 44,018,394 parameters for
    # softmax x 8 heads and 43,657,946 for MGK x 4 heads at V = 267,735), N(0, 0.02) initialisation, warm-up then
    # cosine of the global step over 500k steps, seed 1111, validation every 4000 steps with batch 10. The MGK runs
    # (--attention mgk --heads 4) get sigma^2 = (sqrt(D), sqrt(D)/3) and per-position mixture weights (the authors'
    # form; not passed to kinds that do not take them). Final numbers: `mgk eval RUN --split test --context 256
    # --stride 1`. Deviations from the authors' code: docs/paper-protocol.md.
    "wt103-paper": with_forms(run_config(**AUTHORS_LM, attention="softmax", num_heads=8, checkpoint_every=4000,
                                         log_every=200), AUTHORS_LM_FORMS),
    # Our protocol on the paper's model (Nguyen et al. 2022, Section 4.2; the small setting of Schlag et al. 2021):
    # 16 post-LN layers, d_model 128, head_dim 16,
    # FFN 2048, 256-token segments without memory, batch 96, Adam lr 2.5e-4 (AdamW with weight_decay 0 is Adam),
    # 2000 warm-up steps then cosine to 0, clip 0.25, dropout 0.1; 500k steps as in lmtool-fwp's script (above).
    # Heads: the paper's baseline is --attention softmax --heads 8; MGK runs use 4 or 8 heads. Final numbers:
    # `mgk eval RUN --split test --context 256 --stride 1`.
    "wt103-small": run_config(**_PAPER, steps=500_000, eval_every=4000, checkpoint_every=4000, log_every=200,
                              eval_batch_size=32),
    # CPU preset for a small train prefix of WikiText-103 (e.g. 0.5% of it: --data with a partial train file and the
    # official valid split): the paper's block shape and 256-token segments with 4 layers, FFN 512, batch 8 (2048
    # tokens a step), cutoffs [4000, 20000], lr 1e-3 with 100 warm-up steps then cosine over 1500 steps. Without
    # --data it trains on the generated corpus instead.
    "lm-small": run_config(**{**_PAPER, "num_layers": 4, "ffn_dim": 512, "batch_size": 8, "lr": 1e-3,
                              "warmup_steps": 100},
                           adaptive_cutoffs=[4000, 20000], steps=1500, eval_every=300, checkpoint_every=300,
                           log_every=10, eval_batch_size=32, gen_train=6000, gen_val=600, gen_test=600),
}


# -- datasets and batching ---------------------------------------------------------------------------------------
class LMSegments:
    """A token stream cut into ``num_streams`` contiguous streams of segments (see the module docstring).

    Args:
        tokens: 1-D integer tensor (kept as given, e.g. int32).
        num_streams: B (the global batch size for training, 1 for evaluation).
        segment_len: input tokens per segment.
        drop_last: keep only full segments (training), or end each stream with a shorter one (evaluation, so every
            token after the stream's first is predicted).
    ``len()`` is ``num_streams * segments_per_stream``; :meth:`spans` gives (start, length) of examples, where
    ``length`` is the number of predicted tokens.
    """

    def __init__(self, tokens: Tensor, num_streams: int, segment_len: int, *, drop_last: bool, unk_mapped: int = 0):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if num_streams < 1 or segment_len < 1:
            raise ValueError(f"num_streams and segment_len must be >= 1, got {num_streams}, {segment_len}")
        self.tokens, self.num_streams, self.segment_len, self.drop_last = tokens, num_streams, segment_len, drop_last
        self.unk_mapped = unk_mapped
        self.stream_len = tokens.numel() // num_streams
        predictable = self.stream_len - 1
        n = predictable // segment_len if drop_last else -(-predictable // segment_len)
        if n < 1:
            need = num_streams * (segment_len + 1) if drop_last else 2
            raise ValueError(f"{tokens.numel()} tokens are too few for {num_streams} stream(s) of segments of "
                             f"{segment_len} tokens (need at least {need})")
        self.segments_per_stream = n

    def __len__(self) -> int:
        return self.num_streams * self.segments_per_stream

    @property
    def num_predicted(self) -> int:
        """Tokens predicted by one pass over every example."""
        if self.drop_last:
            return len(self) * self.segment_len
        return self.num_streams * (self.stream_len - 1)

    def spans(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """int64 (start, length) of examples ``index``: inputs ``tokens[start:start+length]``, targets shifted by 1."""
        index = torch.as_tensor(index, dtype=torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise IndexError(f"example index out of range [0, {len(self)})")
        stream, seg = index // self.segments_per_stream, index % self.segments_per_stream
        offset = seg * self.segment_len
        length = (self.stream_len - 1 - offset).clamp(max=self.segment_len)
        return stream * self.stream_len + offset, length


class StreamSampler:
    """Indices of step s: segment ``s mod n`` of streams 0..B-1 (index ``b * n + s mod n``), in stream order.

    Each epoch (n steps) reads every training segment exactly once, in text order; no shuffling, as in the standard
    LM iterator. ``seed`` is accepted for the protocol and unused."""

    def __init__(self, num_examples: int, batch_size: int, seed: int = 0):
        if num_examples < batch_size or num_examples % batch_size:
            raise ValueError(f"the LM train split has {num_examples} segments, not a multiple of batch_size="
                             f"{batch_size}: it is laid out as batch_size streams")
        self.batch_size, self.per_stream = batch_size, num_examples // batch_size
        self._streams = torch.arange(batch_size, dtype=torch.int64) * self.per_stream

    def indices(self, step: int) -> Tensor:
        """int64 (batch_size,) example indices of optimiser step ``step``."""
        return self._streams + step % self.per_stream


def make_batch(dataset: LMSegments, index: Tensor, device) -> dict:
    """Inputs (b, l) int64 and targets (b, l) int64 of examples ``index``; l is the longest span, shorter spans are
    padded at the end (input 0, target IGNORE_INDEX; causal attention keeps the padding out of real positions)."""
    starts, lengths = dataset.spans(index)
    width = max(1, int(lengths.max())) if lengths.numel() else 1
    offs = torch.arange(width, dtype=torch.int64)
    pos = starts.unsqueeze(1) + offs
    pad = offs.unsqueeze(0) >= lengths.unsqueeze(1)
    last = dataset.tokens.numel() - 1
    inputs = dataset.tokens[pos.clamp(max=last)].long().masked_fill(pad, 0)
    targets = dataset.tokens[(pos + 1).clamp(max=last)].long().masked_fill(pad, IGNORE_INDEX)
    return {"input": inputs.to(device), "target": targets.to(device)}


# -- the task ----------------------------------------------------------------------------------------------------
def summarise(sums: dict) -> dict:
    """``{"loss": NLL per predicted token (nats), "ppl": exp(loss), "count": predicted tokens}``."""
    count = float(sums.get("count", 0.0))
    if count <= 0:
        return {"loss": float("nan"), "ppl": float("nan"), "count": 0}
    loss = float(sums["loss"]) / count
    try:
        ppl = math.exp(loss)
    except OverflowError:
        ppl = float("inf")
    return {"loss": loss, "ppl": ppl, "count": round(count)}


@dataclass
class LMTask(Task):
    """What ``mgk train`` needs for language modelling (the :class:`~mgk.tasks.base.Task` interface)."""

    name: str
    splits: dict
    vocab: wt.Vocabulary
    notes: list = field(default_factory=list)
    num_classes: int = 0
    best_metric = ("ppl", "min")

    @property
    def vocab_size(self) -> int:
        """V, the number of words in the vocabulary."""
        return len(self.vocab)

    @property
    def tokenizer(self) -> WordTokenizer:
        """Text <-> word ids of this vocabulary."""
        return WordTokenizer(self.vocab)

    def model_config(self, cfg: RunConfig) -> LMConfig:
        """:func:`mgk.config.lm_config` of ``cfg`` over this vocabulary."""
        return lm_config(cfg, self.vocab_size)

    def build_model(self, cfg: RunConfig) -> nn.Module:
        """The decoder LM of :meth:`model_config` ``(cfg)``."""
        return TransformerLM(self.model_config(cfg))

    @staticmethod
    def sampler(num_examples: int, global_batch: int, seed: int) -> StreamSampler:
        """A :class:`StreamSampler` over the train segments (``seed`` unused: no shuffling). ValueError unless
        ``num_examples`` is a multiple of ``global_batch``."""
        return StreamSampler(num_examples, global_batch, seed)

    @staticmethod
    def batch(dataset: LMSegments, index: Tensor, device) -> dict:
        """``{"input", "target"}`` (b, l) int64 on ``device`` for examples ``index`` (:func:`make_batch`).
        IndexError for an index out of range."""
        return make_batch(dataset, index, device)

    @staticmethod
    def loss(model: nn.Module, batch: dict) -> tuple[Tensor, dict]:
        """Summed NLL of the batch's predicted tokens and ``{"loss": summed NLL, "count": predicted tokens}``.

        The first value is that sum divided by the segment width, so that the loop's division by the number of
        sequences gives the mean NLL per token: the scale the paper's clip of 0.25 and learning rate refer to (the
        metrics always use the exact sums)."""
        nll = model(batch["input"], batch["target"])
        total = nll.sum()
        count = (batch["target"] != IGNORE_INDEX).sum()
        return total / batch["input"].shape[1], {"loss": total.detach(), "count": count}

    summarise = staticmethod(summarise)

    @staticmethod
    def describe(dataset: LMSegments) -> dict:
        """Tokens of the split (``<eos>`` included) and words of it mapped to ``<unk>``."""
        return {"tokens": int(dataset.tokens.numel()), "oov_to_unk": int(getattr(dataset, "unk_mapped", 0))}


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """``mgk data check --task lm``: :func:`mgk.data.wikitext.check_corpus` of the folder."""
    return wt.check_corpus(data)


# -- prepare / build ---------------------------------------------------------------------------------------------
def cache_dir(cfg: RunConfig, data_dir: Path) -> Path:
    """``cfg.data.cache_dir``, else :func:`mgk.data.wikitext.default_cache_dir` of the data folder."""
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else wt.default_cache_dir(data_dir)


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """The data folder (``cfg.data.path``, or a generated corpus in ``run_dir/data``); encodes and caches its splits
    (the trainer keeps the vocabulary with the run: :attr:`LMTask.vocab`)."""
    run_dir = Path(run_dir)
    if cfg.data.path is not None:
        data = Path(cfg.data.path)
    else:
        data = run_dir / "data"
        if wt.find_split_file(data, "train") is None:
            wt.generate_corpus(data, train_lines=cfg.data.gen_train, valid_lines=cfg.data.gen_val,
                               test_lines=cfg.data.gen_test, seed=0)
    wt.load_corpus(data, cache_dir=cache_dir(cfg, data))
    return data


def restore(cfg: RunConfig, vocab: wt.Vocabulary | None = None) -> LMTask:
    """The task of a trained run without its data (:class:`mgk.tasks.base.TaskModule`): ``vocab`` is the run's
    (vocab.txt); ValueError when it is missing or its size is not the one the run was trained with."""
    if vocab is None:
        raise ValueError("a language-model run needs its vocabulary (vocab.txt) to be restored")
    if cfg.model.vocab_size and len(vocab) != cfg.model.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab)} words but the run was trained with {cfg.model.vocab_size}")
    return LMTask("lm", {}, vocab)


def build(cfg: RunConfig, data_dir: Path) -> LMTask:
    """Vocabulary and splits from ``data_dir``: train as ``batch_size`` streams of full ``segment_len`` segments,
    valid/test as consecutive segments (absent splits are noted, not fatal). Raises FileNotFoundError without a
    train split, ValueError when it is too short for one batch."""
    corpus = wt.load_corpus(data_dir, cache_dir=cache_dir(cfg, Path(data_dir)))
    tok = corpus.tokens
    splits = {"train": LMSegments(tok["train"], cfg.optim.batch_size, cfg.data.segment_len, drop_last=True,
                                  unk_mapped=corpus.unk_mapped["train"])}
    notes = list(corpus.notes)
    for ours, theirs in (("val", "valid"), ("test", "test")):
        t = tok[theirs]
        if t is not None and t.numel() < 2:
            notes.append(f"data: {theirs}: fewer than 2 tokens, nothing to predict; treated as absent")
            t = None
        splits[ours] = None if t is None else LMSegments(t, 1, cfg.data.segment_len, drop_last=False,
                                                         unk_mapped=corpus.unk_mapped[theirs])
    train = splits["train"]
    notes.append(f"data: train: {train.num_streams} streams x {train.segments_per_stream} segments of "
                 f"{cfg.data.segment_len} tokens per epoch ({train.num_predicted:,} of {train.tokens.numel():,} tokens "
                 f"predicted)")
    kept, dropped = resolve_cutoffs(cfg.model.adaptive_cutoffs, len(corpus.vocab))
    if dropped:
        notes.append(f"model: adaptive cutoffs {dropped} >= vocabulary size {len(corpus.vocab)} dropped; using "
                     f"{kept if kept else 'none (plain tied softmax)'}")
    if corpus.cache_dir is not None:
        notes.append(f"data: cache {corpus.cache_dir}")
    return LMTask("lm", splits, corpus.vocab, notes)
