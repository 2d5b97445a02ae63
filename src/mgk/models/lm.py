"""The causal decoder language model of the paper's WikiText-103 experiment (Nguyen et al. 2022, Section 4.2; the
small setting of Schlag et al. 2021): tied adaptive input/softmax, sinusoidal positions, post-LN blocks with a ReLU FFN,
any
attention kind, no memory across segments."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention.cache import DecodingCache, token_positions
from .adaptive import TiedAdaptiveSoftmax
from .adaptive_authors import AuthorsAdaptiveSoftmax
from .blocks import TransformerBlock
from .config import LMConfig
from .generation import generate
from .init import check_init, init_lm_paper_

ADAPTIVE_SOFTMAX = {"torch": TiedAdaptiveSoftmax, "authors": AuthorsAdaptiveSoftmax}

__all__ = ["IGNORE_INDEX", "TransformerLM", "sinusoidal_embedding", "sinusoidal_positions"]

IGNORE_INDEX = -100  # a target with this value is not scored


def sinusoidal_embedding(positions: Tensor, dim: int, *, dtype=torch.float32) -> Tensor:
    """(..., dim) encodings ``[sin(p w_0), ..., sin(p w_{k-1}), cos(p w_0), ...]`` of integer ``positions`` (...)
    with ``w_i = 10000^(-2i/dim)`` (Vaswani et al. 2017; the sin/cos halves concatenated as in Transformer-XL)."""
    half = (dim + 1) // 2
    inv_freq = torch.exp(torch.arange(half, device=positions.device, dtype=torch.float64)
                         * (-2.0 * math.log(10000.0) / dim))
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[..., :dim].to(dtype)


def sinusoidal_positions(length: int, dim: int, *, device=None, dtype=torch.float32) -> Tensor:
    """(length, dim) :func:`sinusoidal_embedding` of positions 0 .. length - 1."""
    return sinusoidal_embedding(torch.arange(length, device=device), dim, dtype=dtype)


class TransformerLM(nn.Module):
    """Causal decoder LM: ``sqrt(E) * adaptive_input(x) + positions -> dropout -> post-LN blocks -> dropout ->
    adaptive softmax``.

    ``cfg`` (:class:`~mgk.models.config.LMConfig`): ``vocab_size`` V; ``d_model``, ``num_layers``, ``ffn_dim``,
    ``dropout``: E, depth, FFN width (ReLU), dropout on embeddings, residual branches, FFN inner layer and before the
    softmax; ``attention``: every block's (:class:`~mgk.attention.AttentionConfig`), attending causally (the
    authors' LM projections have no biases, ``mem_transformer.py:92-104``); ``cutoffs``, ``div_value``: of the
    adaptive softmax (cutoffs >= V are dropped; see :attr:`notes`); ``adaptive_softmax``: "torch"
    (:class:`TiedAdaptiveSoftmax`, ``nn.AdaptiveLogSoftmaxWithLoss`` with tail projections, no biases) or "authors"
    (:class:`~mgk.models.adaptive_authors.AuthorsAdaptiveSoftmax`: the tied table with per-word and cluster biases,
    no projections, of the paper's code); ``init``: "torch" (module defaults) or "paper" (N(0, 0.02) weights,
    N(1, 0.02) LayerNorm weights: :func:`mgk.models.init.init_lm_paper_`). ValueError naming a bad one.

    ``forward(tokens)`` gives the hidden states (B, L, E); ``forward(tokens, targets)`` the per-position negative
    log-likelihood (B, L) float32 with 0 where ``targets == IGNORE_INDEX`` (those positions skip the softmax, so
    scoring a few positions of a long window is cheap). Go through ``forward`` when training under DDP: with
    gradients enabled it adds :meth:`TiedAdaptiveSoftmax.touch` so that clusters absent from a rank's batch still
    take part in the step.
    """

    def __init__(self, cfg: LMConfig):
        super().__init__()
        if cfg.adaptive_softmax not in ADAPTIVE_SOFTMAX:
            raise ValueError(f"adaptive_softmax must be one of {tuple(ADAPTIVE_SOFTMAX)}, got "
                             f"{cfg.adaptive_softmax!r}")
        check_init(cfg.init)
        self.config = cfg
        self.d_model = cfg.d_model
        cutoffs = None if cfg.cutoffs is None else list(cfg.cutoffs)
        self.adaptive = ADAPTIVE_SOFTMAX[cfg.adaptive_softmax](cfg.vocab_size, cfg.d_model, cutoffs,
                                                               div_value=cfg.div_value)
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.attention, cfg.ffn_dim, cfg.dropout, activation="relu",
                             norm_first=False)
            for _ in range(cfg.num_layers))
        self.drop = nn.Dropout(cfg.dropout)
        self.out_drop = nn.Dropout(cfg.dropout)
        if cfg.init == "paper":
            init_lm_paper_(self)

    @property
    def notes(self) -> list[str]:
        """Log lines about choices made at construction (dropped cutoffs)."""
        return list(self.adaptive.notes)

    @property
    def vocab_size(self) -> int:
        """V, the number of token ids the model embeds and scores."""
        return self.adaptive.vocab_size

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters counted once; ``non_embedding`` leaves out the tied input/output weights."""
        total = sum(p.numel() for p in self.parameters())
        return total - sum(p.numel() for p in self.adaptive.parameters()) if non_embedding else total

    def num_attention_parameters(self) -> int:
        """Parameters of the blocks' attention modules (projections and mixture weights)."""
        return sum(p.numel() for block in self.blocks for p in block.attn.parameters())

    def hidden(self, tokens: Tensor, *, key_padding_mask: Tensor | None = None,
               past_key_values: DecodingCache | None = None) -> Tensor:
        """Final hidden states (B, L, E) of integer tokens (B, L); position t sees tokens 0..t only.

        ``past_key_values`` (:meth:`new_cache`): decode: ``tokens`` are the new tokens after those the cache has
        seen, attended with them and added to it; positions continue per row. Decoding is inference: run it under
        ``torch.no_grad()`` or ``torch.inference_mode()`` (with gradients enabled the layers raise ValueError; see
        :meth:`mgk.attention.base.AttentionBase.forward`). ``key_padding_mask`` (B, L) bool, True = padding (the
        left padding of prompts of different lengths): padded tokens are never attended and each row's positions
        count its real tokens only (:func:`mgk.attention.cache.token_positions`), so a row gives what it gives alone.
        Without a cache this is the uncached causal forward, with gradients, so a padded batch trains as its rows
        alone. Hidden states at padded positions are meaningless. ValueError naming the argument for bad shapes."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor of shape (B, L), got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        if past_key_values is None:
            if key_padding_mask is not None:
                return self._hidden_padded(tokens, key_padding_mask)
            x = self.adaptive.embed(tokens.long())
            return self._blocks(x + sinusoidal_positions(tokens.shape[1], self.d_model, device=x.device,
                                                         dtype=x.dtype))
        return self._blocks(self.decode_inputs(tokens, past_key_values, key_padding_mask=key_padding_mask),
                            key_padding_mask, past_key_values)

    def decode_inputs(self, tokens: Tensor, past_key_values: DecodingCache, *,
                      key_padding_mask: Tensor | None = None) -> Tensor:
        """(B, L, E) the first layer's inputs for new ``tokens`` (B, L) after those ``past_key_values`` has seen:
        their embeddings plus the sinusoids of each row's positions (:meth:`hidden`'s first half when decoding;
        :meth:`log_probs_from_inputs` is the rest). ValueError naming the argument for bad shapes or a cache that
        is not this model's."""
        x = self.adaptive.embed(tokens.long())
        return x + sinusoidal_embedding(self._positions(tokens, key_padding_mask, past_key_values), self.d_model,
                                        dtype=x.dtype)

    def log_probs_from_inputs(self, x: Tensor, past_key_values: DecodingCache) -> Tensor:
        """(B, V) next-token log-probabilities after the last of new tokens given as :meth:`decode_inputs` (B, L, E),
        decoded through ``past_key_values`` (no padding among them): the part of a decoding step that
        ``torch.compile`` traces in one graph (:mod:`mgk.models.compiled_decode`; the embedding's id checks and the
        positions stay outside)."""
        return self.adaptive.log_prob(self.out_drop(self._blocks(x, None, past_key_values)[:, -1]))

    def _blocks(self, x: Tensor, key_padding_mask: Tensor | None = None,
                cache: DecodingCache | None = None) -> Tensor:
        """Embedded inputs with positions (B, L, E) through dropout and the causal blocks (decoding with ``cache``)."""
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, key_padding_mask=key_padding_mask, is_causal=True,
                      past_key_values=None if cache is None else cache[i])
        return x

    def _hidden_padded(self, tokens: Tensor, key_padding_mask: Tensor) -> Tensor:
        """:meth:`hidden` of a padded batch without a cache: the uncached causal forward of each row's real tokens
        (:meth:`_compacted`). normalize="length" scales by the tensor length, so there rows of one real length go
        through together and each row is scaled by its own length, as alone (and as decoding counts it)."""
        self._check_padding(tokens, key_padding_mask)
        counts = (~key_padding_mask).sum(dim=1)
        if tokens.shape[0] == 0 or not any(getattr(block.attn, "normalize", None) == "length"
                                           for block in self.blocks):
            return self._compacted(tokens, key_padding_mask, int(counts.max()) if tokens.shape[0] else 0)
        out = None
        for n in counts.unique().tolist():
            rows = (counts == n).nonzero().squeeze(1)
            h = self._compacted(tokens[rows], key_padding_mask[rows], n)
            out = h.new_zeros(tokens.shape[0], *h.shape[1:]) if out is None else out
            out = out.index_copy(0, rows, h)
        return out

    def _compacted(self, tokens: Tensor, key_padding_mask: Tensor, n: int) -> Tensor:
        """States (B, L, E) of the uncached forward over each row's real tokens moved to its front in order (a
        stable sort of the mask), put back in the caller's order. There a row's tokens sit at their positions
        counted from its first real token, as decoding counts them (:func:`mgk.attention.cache.token_positions`;
        per-position mixture weights read the key index as the position); the padding among the first ``n``
        columns (``n`` = the longest row's real tokens) is masked as keys. Later columns, padding in every row, are
        left out (so a batch padded past the max_len of per-position weights runs when its rows fit): their states
        are zeros."""
        B, L = tokens.shape
        order = key_padding_mask.to(torch.int8).argsort(dim=1, stable=True)  # real tokens first, in order
        kept = order[:, :n]
        positions = token_positions(torch.zeros(B, dtype=torch.int64, device=tokens.device), ~key_padding_mask, L)
        x = self.adaptive.embed(tokens.long().gather(1, kept))
        x = x + sinusoidal_embedding(positions.gather(1, kept), self.d_model, dtype=x.dtype)
        h = self._blocks(x, key_padding_mask.gather(1, kept)) if n else x
        h = torch.cat([h, h.new_zeros(B, L - n, h.shape[-1])], dim=1)
        return h.gather(1, order.argsort(dim=1).unsqueeze(-1).expand_as(h))

    def _check_padding(self, tokens: Tensor, key_padding_mask: Tensor | None) -> None:
        """ValueError naming ``key_padding_mask`` unless it is None or bool of the tokens' shape (B, L)."""
        if key_padding_mask is not None and (not isinstance(key_padding_mask, Tensor)
                                             or key_padding_mask.dtype != torch.bool
                                             or key_padding_mask.shape != tokens.shape):
            what = (f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}" if isinstance(key_padding_mask, Tensor)
                    else type(key_padding_mask).__name__)
            raise ValueError(f"key_padding_mask must be bool of the tokens' shape {tuple(tokens.shape)} (True = "
                             f"padding), got {what}")

    def _positions(self, tokens: Tensor, key_padding_mask: Tensor | None, cache: DecodingCache) -> Tensor:
        """(B, L) positions of new tokens after those ``cache`` has seen, per row."""
        B, L = tokens.shape
        if not isinstance(cache, DecodingCache) or len(cache) != len(self.blocks):
            what = f"a DecodingCache of {len(cache)} layers" if isinstance(cache, DecodingCache) else \
                type(cache).__name__
            raise ValueError(f"past_key_values must be a DecodingCache of this model's {len(self.blocks)} layers "
                             f"(model.new_cache()), got {what}")
        if len({layer.length for layer in cache}) > 1:
            raise ValueError(f"past_key_values has layers of different lengths {[layer.length for layer in cache]}: "
                             "a call through it was interrupted part-way; start a new cache (model.new_cache())")
        self._check_padding(tokens, key_padding_mask)
        seen = cache.seen if cache.seen is not None else torch.zeros(B, dtype=torch.int64, device=tokens.device)
        if seen.shape[0] != B:
            raise ValueError(f"past_key_values was filled for a batch of {seen.shape[0]} rows; tokens have {B}")
        return token_positions(seen, None if key_padding_mask is None else ~key_padding_mask, L)

    def new_cache(self, capacity: int | None = None) -> DecodingCache:
        """An empty :class:`~mgk.attention.cache.DecodingCache`, one layer cache per block (room for ``capacity``
        tokens allocated at the first call)."""
        return DecodingCache(block.attn.new_cache(capacity) for block in self.blocks)

    def next_log_probs(self, tokens: Tensor, *, key_padding_mask: Tensor | None = None,
                       past_key_values: DecodingCache | None = None) -> Tensor:
        """(B, V) float32 log-probabilities of the token after the last of ``tokens`` (B, L), arguments as
        :meth:`hidden`."""
        h = self.hidden(tokens, key_padding_mask=key_padding_mask, past_key_values=past_key_values)[:, -1]
        return self.adaptive.log_prob(self.out_drop(h))

    def position_limit(self) -> tuple[str, int] | None:
        """(option, max_len) of the first block whose attention has mixture weights per key position (which cover
        max_len positions only), or None when any position can be decoded."""
        limits = [block.attn.mixture.position_limit() for block in self.blocks
                  if hasattr(getattr(block.attn, "mixture", None), "position_limit")]
        limits = [lim for lim in limits if lim is not None]
        return min(limits, key=lambda lim: lim[1]) if limits else None

    generate = generate

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """Hidden states (B, L, E) of integer ``tokens`` (B, L) (:meth:`hidden`); with ``targets`` (B, L) int ids the
        per-position negative log-likelihood (B, L) float32, 0 where ``targets == IGNORE_INDEX``. ValueError when
        ``targets`` differ in shape from ``tokens`` or hold an id outside [0, V), and as :meth:`hidden`; IndexError
        for a token id outside [0, V)."""
        h = self.hidden(tokens)
        if targets is None:
            return h
        if targets.shape != tokens.shape:
            raise ValueError(f"targets {tuple(targets.shape)} must have the shape of tokens {tuple(tokens.shape)}")
        h = self.out_drop(h)
        scored = targets != IGNORE_INDEX
        values = self.adaptive.nll(h[scored], targets[scored].long())
        out = torch.zeros(targets.shape, dtype=values.dtype, device=values.device).masked_scatter(scored, values)
        if torch.is_grad_enabled():  # every tied weight takes part in the step, also rare clusters (DDP)
            out = out + self.adaptive.touch()
        return out

    def log_probs(self, tokens: Tensor) -> Tensor:
        """Log-probabilities of the next token at every position, (B, L, V) float32 (for analysis and tests)."""
        h = self.out_drop(self.hidden(tokens))
        return self.adaptive.log_prob(h.reshape(-1, h.shape[-1])).view(*tokens.shape, -1)
