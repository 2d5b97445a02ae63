"""The attention module that sits where a Hugging Face model had its own: an mgk module of any registered kind,
called with the model's masks, rotary embeddings and cache."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...functional.masks import causal_mask
from .cache import mgk_layer

try:  # transformers 5.x records output_attentions=True by hooks it installs on its own attention classes only
    from transformers.utils.output_capturing import install_output_capuring_hook as _install_record_hook
except ImportError:  # older versions read the maps from the attention's second output
    _install_record_hook = None

__all__ = ["HFAttention", "MaskLayout", "key_valid", "mask_layout", "record_maps", "with_cu_seq_lens",
           "with_packed_positions"]


class _Catch:
    """Stands for a module in ``install_output_capuring_hook``: keeps the hook it is given instead of registering it."""

    def __init__(self):
        self.hooks: list = []

    def register_forward_hook(self, hook, *args, **kwargs) -> None:
        """Keep ``hook`` (nn.Module's signature; the other arguments are ignored), registering nothing."""
        self.hooks.append(hook)


def _caught_record_hook():
    """transformers' hook that records an attention's maps (its second output) for ``output_attentions=True``, or
    None before transformers 5. Caught rather than installed: it is a local closure, which a model holding it cannot
    pickle (``torch.save(model)``, multiprocessing, ``copy.deepcopy``); mgk's modules hold :func:`record_maps`."""
    if _install_record_hook is None:
        return None
    catch = _Catch()
    _install_record_hook(catch, "attentions", 1)
    if len(catch.hooks) != 1:
        raise ImportError("mgk.integrations.hf: transformers' install_output_capuring_hook registered "
                          f"{len(catch.hooks)} hooks, not one; use a transformers version in its supported range")
    return catch.hooks[0]


_RECORD_MAPS = _caught_record_hook()


def record_maps(module: nn.Module, args, output) -> None:
    """Forward hook of every :class:`HFAttention`: hands its maps (``output[1]``, (B, H, L, S) or None) to the
    collector transformers 5 runs for ``output_attentions=True``, as the model's own attention's hook does. A
    module-level function, so that a model holding it pickles by reference; nothing before transformers 5 (the
    model reads the maps from the attention's output)."""
    if _RECORD_MAPS is not None:
        _RECORD_MAPS(module, args, output)

# what the decoder layers of the supported transformers versions call the cache argument
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


def key_valid(attention_mask, L: int) -> Tensor | None:
    """(B, L) bool, True = a real token, of the last L keys of the mask a transformers model passes its attention
    modules, or None (no padding).

    The model's mask is (B, 1, L, S) bool (True = may attend) or float (0 = may attend, a large negative number
    not), a (B, S) 0/1 padding mask (flash attention's form), or None. Its last query row sees every real key
    before it (causal masks are lower triangular, padding masks hide keys only), so it gives the keys' padding;
    the causal order itself is the architecture's, applied by :class:`HFAttention` whatever the mask (transformers
    PR #45811: an attention that takes causality from the mask alone gets none when the model passes None).
    ValueError naming ``attn_implementation`` for another form (flex attention's BlockMask)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() not in (2, 4):
        raise ValueError(f"mgk attention takes the model's mask as a (B, S) or (B, 1, L, S) tensor, got "
                         f"{type(attention_mask).__name__}: load the model with attn_implementation='sdpa' or "
                         "'eager'")
    row = attention_mask if attention_mask.dim() == 2 else attention_mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        valid = row
    elif row.is_floating_point() and attention_mask.dim() == 4:
        valid = row > torch.finfo(row.dtype).min / 2
    else:
        valid = row != 0
    valid = valid[:, -L:]
    return None if bool(valid.all()) else valid


class MaskLayout(NamedTuple):
    """What the mask a transformers model passes its attention asks of one call (:func:`mask_layout`).

    ``form``: "plain" (the architecture's causality and key padding only), "packed" (several sequences in a row,
    each attending only to itself: a block-diagonal mask, which transformers builds from ``position_ids`` that restart
    at 0) or "general" (any other mask). ``valid``: (B, S) bool, True = a real token (a key some real query may
    attend to), or None (no padding). ``segments``: "packed" only, (B, L) int64, the sequence of each token counted
    from 1 in its row, 0 for padding. ``mask``: "general" only, (B, 1, L, S) bool True = may attend, or float added
    to the logits (-inf = not allowed)."""

    form: str
    valid: Tensor | None = None
    segments: Tensor | None = None
    mask: Tensor | None = None


def _allowed(attention_mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """(B, L, S) bool True = may attend, and the float additive part of a float mask (None when all zero), of a
    (B, 1, L, S) mask: bool True = may attend, or float with a large negative number (transformers' finfo.min) or
    -inf = not allowed."""
    m = attention_mask[:, 0]
    if m.dtype == torch.bool:
        return m, None
    if not m.is_floating_point():
        return m != 0, None
    allowed = m > torch.finfo(m.dtype).min / 2
    bias = torch.where(allowed, m, torch.zeros((), dtype=m.dtype, device=m.device))
    return allowed, (bias if bool(bias.any()) else None)


def _differs(allowed: Tensor, expected: Tensor, query_ok: Tensor) -> bool:
    """Whether the masks differ on a real query's row (padding rows hold anything: their outputs are unused)."""
    return bool(((allowed ^ expected) & query_ok.unsqueeze(-1)).any())


def _segments(allowed: Tensor, query_ok: Tensor) -> Tensor:
    """(B, L) int64: the packed sequence of each real token, counted from 1 in its row (0 for padding). A real token
    starts a sequence when it may attend to no earlier real token."""
    L = allowed.shape[-1]
    earlier = torch.ones(L, L, dtype=torch.bool, device=allowed.device).tril(-1)
    sees_earlier = (allowed & earlier & query_ok.unsqueeze(1)).any(-1)
    start = query_ok & ~sees_earlier
    return torch.where(query_ok, start.long().cumsum(1), 0)


def mask_layout(attention_mask, L: int, causal: bool) -> MaskLayout:
    """The :class:`MaskLayout` of the mask a transformers model passes its attention modules for L queries.

    Args:
        attention_mask: None (no padding: causality comes from the architecture, transformers PR #45811), a (B, S)
            0/1 padding mask (flash attention's form), or (B, 1, L, S) bool (True = may attend) or float (0 = may
            attend, transformers' finfo.min or -inf not; other values are added to the logits).
        L: the number of queries (the last L of the S keys).
        causal: whether the architecture is causal (the mask is then checked against the bottom-right causal order).
    Returns:
        "plain" when the mask is the causal order (when ``causal``) and key padding on every real query's row (a real
        query is one that may attend to its own key); "packed" when it is block-diagonal (L == S, each real token
        attending to the real tokens of its own sequence only); "general" otherwise.
    Raises:
        ValueError naming ``attn_implementation`` for another form (flex attention's BlockMask)."""
    if attention_mask is None:
        return MaskLayout("plain")
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() not in (2, 4):
        raise ValueError(f"mgk attention takes the model's mask as a (B, S) or (B, 1, L, S) tensor, got "
                         f"{type(attention_mask).__name__}: load the model with attn_implementation='sdpa' or "
                         "'eager'")
    if attention_mask.dim() == 2:
        valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        return MaskLayout("plain", None if bool(valid.all()) else valid)
    if attention_mask.shape[1] != 1:  # a mask per head: passed on as it is
        return MaskLayout("general", mask=attention_mask)
    allowed, bias = _allowed(attention_mask)
    S = allowed.shape[-1]
    own = torch.arange(L, device=allowed.device)
    query_ok = allowed[:, own, own + (S - L)]  # a real query may attend to its own key; a padding one to none
    key_ok = (allowed & query_ok.unsqueeze(-1)).any(1)
    valid = None if bool(key_ok.all()) else key_ok
    order = causal_mask(L, S, allowed.device) if causal else torch.ones((), dtype=torch.bool, device=allowed.device)
    if bias is not None:
        return MaskLayout("general", valid, mask=attention_mask)
    if not _differs(allowed, key_ok.unsqueeze(1) & order, query_ok):
        return MaskLayout("plain", valid)
    if L == S:
        segments = _segments(allowed, query_ok)
        same = segments.unsqueeze(2) == segments.unsqueeze(1)
        if not _differs(allowed, same & query_ok.unsqueeze(1) & order, query_ok):
            return MaskLayout("packed", None if bool(query_ok.all()) else query_ok, segments=segments)
    return MaskLayout("general", valid, mask=allowed.unsqueeze(1))


def _cu_starts(cu_seq_lens, name: str, L: int, device) -> Tensor:
    """(L,) bool, True where a sequence starts, of flash attention's cumulative lengths ``cu_seq_lens`` (num_seqs + 1,)
    over one flattened row of L tokens; ValueError naming ``name`` unless they run from 0 to L, strictly increasing."""
    cu = torch.as_tensor(cu_seq_lens, device=device)
    if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1D integer tensor (num_seqs + 1,) of cumulative lengths, got "
                         f"{cu.dtype} of shape {tuple(cu.shape)}")
    if int(cu[0]) != 0 or int(cu[-1]) != L or not bool((cu[1:] > cu[:-1]).all()):
        raise ValueError(f"{name} must increase strictly from 0 to the row's length {L}, got {cu.tolist()}")
    return torch.zeros(L, dtype=torch.bool, device=device).index_fill_(0, cu[:-1].long(), True)


def _position_starts(position_ids: Tensor) -> Tensor:
    """(R, L) bool: where position_ids (R, L) restart (the first token, and wherever a position is not the one before
    it plus 1: transformers' ``find_packed_sequence_indices``)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


def with_packed_positions(layout: MaskLayout, B: int, L: int, position_ids) -> MaskLayout:
    """``layout`` with sequences packed into a row by ``position_ids`` alone read in, for every call of a causal
    model: a position that restarts at 0 after a real token of its row starts a new sequence
    (``DataCollatorWithFlattening()`` numbers each sequence from 0). transformers builds its block mask from
    restarting positions only without a cache and without a 2D ``attention_mask``; with either (the configs'
    ``use_cache=True`` in eval and in training as ``Trainer`` runs it, or a padding mask) the sequences would see each
    other, so one rule holds whatever the call: the output never depends on whether a cache was asked for. Positions
    that jump forward (PoSE-style gaps) are one sequence, as positions decide angles, not boundaries; padding keeps
    its own rule (the mask's: a left-padded row's first real token, position 0 after padding, starts no new
    sequence).

    Args:
        layout: the call's :func:`mask_layout`; only a "plain" one (causality and key padding) is read further.
        B, L: the call's batch size and number of queries.
        position_ids: (B, L) or (1, L) integer positions, or None.
    Returns:
        ``layout`` unchanged when nothing restarts; else "packed", its ``valid`` kept and ``segments`` (B, L) counted
        from 1 in each row (0 for padding)."""
    if layout.form != "plain" or not isinstance(position_ids, Tensor) or L < 2:
        return layout
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, B) or position_ids.shape[1] != L:
        return layout
    real = (torch.ones(B, L, dtype=torch.bool, device=position_ids.device) if layout.valid is None
            else layout.valid[:, -L:].to(position_ids.device))
    after_real = torch.zeros_like(real)
    after_real[:, 1:] = real[:, :-1]
    restarts = real & after_real & (position_ids == 0)
    if not bool(restarts.any()):
        return layout
    starts = restarts | (real & ~after_real)
    return MaskLayout("packed", layout.valid, segments=starts.long().cumsum(-1) * real)


def with_cu_seq_lens(layout: MaskLayout, B: int, L: int, device, *, cu_seq_lens_q=None, cu_seq_lens_k=None,
                     position_ids=None) -> MaskLayout:
    """``layout`` with the packing flash attention's keyword arguments describe read in: a "packed"
    :class:`MaskLayout` whose ``segments`` (1, L) follow ``cu_seq_lens_q`` when it holds several sequences.

    Args:
        layout: the :func:`mask_layout` of the call's mask.
        B, L: the call's batch size and number of queries (self-attention: as many keys).
        cu_seq_lens_q, cu_seq_lens_k: None, or (num_seqs + 1,) int32 cumulative lengths of the sequences flattened
            into one row (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``); either may be given alone.
        position_ids: the (1, L) or (L,) positions the model passed, or None. Restarts (positions not the previous
            plus 1) must fall on sequence starts; positions running on across a start (the model's default 0..L-1
            when none were passed) are accepted, as flash attention does.
    Returns:
        ``layout`` unchanged when neither is given or they hold one sequence; else "packed" with their segments.
    Raises:
        ValueError naming ``cu_seq_lens_q`` / ``cu_seq_lens_k``: B != 1, not a 1D integer tensor, not strictly
        increasing from 0 to L, q and k differing, a restart of ``position_ids`` inside a sequence, or a mask with
        padding, a general mask or a block mask whose sequences start elsewhere."""
    given = [(n, c) for n, c in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)) if c is not None]
    if not given:
        return layout
    names = " / ".join(n for n, _ in given)
    if B != 1:
        raise ValueError(f"{names} describe sequences flattened into one row (batch size 1), got batch size {B}")
    starts = [_cu_starts(c, n, L, device) for n, c in given]
    if len(starts) == 2 and not torch.equal(starts[0], starts[1]):
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k differ in a self-attention call: "
                         f"{torch.as_tensor(cu_seq_lens_q).tolist()} vs {torch.as_tensor(cu_seq_lens_k).tolist()}")
    start = starts[0]
    if isinstance(position_ids, Tensor) and position_ids.dim() <= 2 and position_ids.shape[-1] == L:
        if bool((_position_starts(position_ids.reshape(-1, L).to(device)) & ~start).any()):
            raise ValueError(f"{names} and position_ids disagree: position_ids restart inside a sequence of {names}")
    if layout.form == "general" or layout.valid is not None:
        raise ValueError(f"{names} describe every token of the row as a sequence's; the attention_mask the model "
                         "passed has padding or is not block-diagonal: pass one or the other")
    if layout.form == "packed" and bool(((layout.segments[0, 1:] != layout.segments[0, :-1]) & ~start[1:]).any()):
        raise ValueError(f"{names} and the block-diagonal attention_mask disagree on where the sequences start")
    if int(start.sum()) == 1:  # one sequence: the plain call (a cache's later steps take plain layouts only)
        return layout
    # read even when the mask is plain: transformers builds the block mask from position_ids only without a cache
    return MaskLayout("packed", segments=start.long().cumsum(0).unsqueeze(0))


class _Packed(NamedTuple):
    """Where the real tokens of a packed batch go in a batch of one sequence per row (right-padded)."""

    source: Tensor  # (T,) flat index b * L + i of each real token
    dest: Tensor  # (T,) flat index g * Lmax + p in the new batch (sequence g, position p)
    group: Tensor  # (B, L) sequence index of each token (0 for padding; with ``real``)
    place: Tensor  # (B, L) position of each token in its sequence
    real: Tensor  # (B, L) bool
    lengths: Tensor  # (N,) lengths of the N sequences
    width: int  # Lmax


def _unpack_plan(segments: Tensor) -> _Packed:
    """The :class:`_Packed` plan of segments (B, L) (sequence numbers from 1 per row, 0 = padding)."""
    B, L = segments.shape
    real = segments > 0
    first = segments.max(dim=1).values.cumsum(0) - segments.max(dim=1).values  # sequences before each row
    group = torch.where(real, first.unsqueeze(1) + segments - 1, 0)
    source = real.reshape(-1).nonzero().squeeze(1)
    g = group.reshape(-1)[source]
    T = g.numel()
    idx = torch.arange(T, device=g.device)
    starts = torch.ones(T, dtype=torch.bool, device=g.device)
    starts[1:] = g[1:] != g[:-1]
    place_real = idx - torch.where(starts, idx, 0).cummax(0).values
    lengths = torch.bincount(g, minlength=int(g.max()) + 1 if T else 0)
    width = int(lengths.max()) if T else 0
    place = torch.zeros(B * L, dtype=torch.int64, device=g.device).index_copy(0, source, place_real).view(B, L)
    return _Packed(source, g * width + place_real, group, place, real, lengths, width)


def _to_sequences(t: Tensor, plan: _Packed) -> Tensor:
    """(B, L, F) -> (N, Lmax, F): each packed sequence on its own row, zeros after its end."""
    flat = t.reshape(-1, t.shape[-1])[plan.source]
    out = flat.new_zeros(plan.lengths.numel() * plan.width, t.shape[-1]).index_copy(0, plan.dest, flat)
    return out.view(plan.lengths.numel(), plan.width, t.shape[-1])


def _from_sequences(out: Tensor, plan: _Packed, B: int, L: int) -> Tensor:
    """(N, Lmax, F) -> (B, L, F): each real token's row back in its place, zeros at padding."""
    flat = out.reshape(-1, out.shape[-1])[plan.dest]
    return flat.new_zeros(B * L, out.shape[-1]).index_copy(0, plan.source, flat).view(B, L, -1)


def _weights_back(w: Tensor, plan: _Packed) -> Tensor:
    """Per-head maps (N, H, Lmax, Lmax) of the sequences -> (B, H, L, L) of the packed rows (0 across sequences)."""
    gi, pi_, pj = plan.group.unsqueeze(2), plan.place.unsqueeze(2), plan.place.unsqueeze(1)
    picked = w[gi, :, pi_, pj]  # (B, L, L, H)
    same = (gi == plan.group.unsqueeze(1)) & plan.real.unsqueeze(2) & plan.real.unsqueeze(1)
    return torch.where(same.unsqueeze(-1), picked, 0.0).permute(0, 3, 1, 2)


class HFAttention(nn.Module):
    """An mgk attention module (:attr:`attn`, any registered kind) in a transformers model's attention slot.

    Args:
        attn: the mgk module (batch_first=True), built by :func:`mgk.swap_attention`.
        layer_idx: the model's index of this layer (its slot in the model's cache).
        causal: whether the architecture is causal (Llama, GPT-2) or bidirectional (BERT). Applied on every call,
            whatever mask the model passes (None when it has no padding).
        rotary: the model's own ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=...)`` for rotary models, else
            None. Whatever the query and every key projection return (the outermost submodules of :attr:`attn`
            named ``q_proj`` / ``k_proj``: MGK's M components, a GQA kind's G heads, and the same modules once
            wrapped, e.g. by peft's LoRA layers, base output and adapter part together) is rotated by it, head by
            head, so the kind's own core, cache and options apply unchanged; sMGK's learned shifts apply after the
            rotation.
        resid_dropout: GPT-2's dropout after the output projection (kept from the old module), else None.

    ``forward(hidden_states, attention_mask=None, position_embeddings=None, cache=None, ...)`` takes what the
    model's layers pass (other keyword arguments are ignored) and returns ``(output (B, L, E), weights)``.

    Masks (:func:`mask_layout`): causality and key padding go to the kind as ``key_padding_mask`` (a row's
    per-position mixture weights then count its positions from its first real token); several sequences packed in a
    row (a block-diagonal mask) are attended each on its own, as if alone (each kind, each prior restarting); so are
    sequences flattened into one row that flash attention's keyword arguments ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    describe (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``; read whatever the mask, also with a
    cache, where transformers builds no block mask; malformed ones are a ValueError, :func:`with_cu_seq_lens`), and
    in a causal model sequences told apart by ``position_ids`` restarting at 0 (``DataCollatorWithFlattening()``;
    :func:`with_packed_positions`: with or without a cache or a padding mask, one rule); any
    other 4D mask goes to the kind as ``attn_mask`` (the linear kinds refuse one that depends on the query, in one
    line).

    Weights: with ``output_attentions=True`` (the keyword, which the Llama family and BERT pass their attention, or
    :attr:`maps_asked`, which the model sets for the call: GPT-2 drops the keyword before its layers;
    :func:`mgk.integrations.hf.maps.listen_for_maps`) they are the kind's per-head maps (B, H, L, S) float (the
    linear kinds' explicit ones), recorded where transformers collects the model's; a kind that returns none, or a
    call on a cache that already holds tokens, is a ValueError in one line. Otherwise None.

    Cache: with one (a ``DynamicCache``; :func:`mgk.integrations.hf.mgk_layer`) an inference call is the layer's
    cached decoding step: its new tokens attend to everything the layer has seen. A training call (the module in
    training mode with gradients enabled, e.g. ``use_cache=True``, many configs' default) is the uncached forward
    and leaves the cache untouched (nothing built that no one reads); on a cache that already holds this layer's
    tokens it is a ValueError. With gradients on in eval mode, the first call's output is the uncached forward's
    and the cache is filled without gradient besides. A cache takes plain masks after its first call; one whose
    first call was packed refuses any later call in one line (its sequences share a row: a step would see them all),
    and a later chunk whose positions restart at 0 in a row the cache holds tokens of is refused alike. A filled
    cache called with another batch size is refused first, in one line naming the cache and both sizes.
    """

    # set by the model for the length of a call that asks for the maps (output_attentions; .maps.listen_for_maps)
    maps_asked = False

    def __init__(self, attn: nn.Module, *, layer_idx: int | None, causal: bool, rotary=None,
                 resid_dropout: nn.Module | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = causal
        self.resid_dropout = resid_dropout if resid_dropout is not None else nn.Identity()
        self._rotary = rotary
        self._position: tuple[Tensor, Tensor] | None = None  # (cos, sin) of the call in progress
        self._hooks: list = []
        self._hooked: list[nn.Module] = []  # the projections the hooks are on (re-read on each call)
        self.attn = attn
        self.set_module(attn)
        if _RECORD_MAPS is not None:  # the maps of output_attentions=True recorded as the model's own attention's
            self.register_forward_hook(record_maps)

    def set_module(self, attn: nn.Module) -> None:
        """Make ``attn`` the mgk module (rotating what its query and key projections return, for rotary models);
        ValueError when a rotary model's new module has no ``k_proj``."""
        self.attn = attn
        self._hook_projections()
        if self._rotary is not None and not any(n.rpartition(".")[2] == "k_proj" for n, _ in self._projections()):
            raise ValueError(f"swap_attention: {type(attn).__name__} has no key projection k_proj to apply the "
                             "model's rotary embeddings to")

    def _projections(self) -> list[tuple[str, nn.Module]]:
        """The outermost submodules of :attr:`attn` named ``q_proj`` or ``k_proj`` (a wrapper, not what it wraps)."""
        found: list[tuple[str, nn.Module]] = []
        for name, module in self.attn.named_modules():  # pre-order: a wrapper comes before what it holds
            if name.rpartition(".")[2] in ("q_proj", "k_proj") and not any(name.startswith(f + ".") for f, _ in found):
                found.append((name, module))
        return found

    def _hook_projections(self) -> None:
        """Rotation hooks on the current projections; moved when a projection was replaced since (peft wraps
        ``q_proj`` / ``k_proj`` after the swap: the rotation must include the adapter's part)."""
        if self._rotary is None:
            return
        current = [m for _, m in self._projections()]
        if len(current) == len(self._hooked) and all(a is b for a, b in zip(current, self._hooked)):
            return
        for hook in self._hooks:
            hook.remove()
        self._hooked = current
        self._hooks = [m.register_forward_hook(self._rotate) for m in current]

    def _rotate(self, module: nn.Module, inputs, out: Tensor) -> Tensor | None:
        """A projection's output (B, L, n * D) rotated per D-wide head by the call's (cos, sin) (B, L, D), in the
        projection's dtype: under autocast the projections give bfloat16 while the model's cos / sin stay float32,
        and the rotation must not promote the query and keys past the values (the kind's core computes its scores in
        float32 whatever it is given, docs/implementation.md)."""
        if self._position is None:
            return None
        cos, sin = self._position
        heads = out.unflatten(-1, (-1, cos.shape[-1]))
        return self._rotary(heads, heads[..., :0, :], cos, sin, unsqueeze_dim=2)[0].flatten(-2).to(out.dtype)

    def forward(self, hidden_states: Tensor, *args, attention_mask=None, position_embeddings=None, **kwargs):
        """``(output (B, L, E), weights (B, H, L, S) float or None)`` of ``hidden_states`` (B, L, E), with the mask,
        cache and weights rules of the class docstring. TypeError for a positional argument after
        ``hidden_states``; ValueError for cross-attention, a rotary model's call without ``position_embeddings``
        (cos, sin), ``output_attentions`` on a kind that returns no weights, and a mask or cache it cannot take."""
        if args:
            raise TypeError(f"HFAttention takes hidden_states and keyword arguments, got {len(args)} more "
                            "positional ones")
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("mgk attention replaces self-attention only; cross-attention was not swapped")
        cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
        if self._rotary is not None:
            if position_embeddings is None:
                raise ValueError("this rotary model's layer was called without position_embeddings (cos, sin)")
            self._hook_projections()
            self._position = position_embeddings
        want = bool(kwargs.get("output_attentions")) or self.maps_asked
        try:
            B, L = hidden_states.shape[:2]
            layout = with_cu_seq_lens(mask_layout(attention_mask, L, self.is_causal), B, L, hidden_states.device,
                                      cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
                                      cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
                                      position_ids=kwargs.get("position_ids"))
            positions = kwargs.get("position_ids")
            if self.is_causal:  # transformers reads the restarts only without a cache and a 2D mask: mgk always
                layout = with_packed_positions(layout, B, L, positions)
            out, weights = self._attend(hidden_states, layout, cache, want, positions)
        finally:
            self._position = None
        if want and weights is None:
            raise ValueError(f"output_attentions: {type(self.attn).__name__} returns no attention weights; call "
                             "without output_attentions")
        return self.resid_dropout(out), weights

    def _attend(self, x: Tensor, layout: MaskLayout, cache, want: bool, positions=None) -> tuple[Tensor, Tensor | None]:
        if cache is None:
            return self._uncached(x, layout, want)
        if self.training and torch.is_grad_enabled():
            held = _held(cache, self.layer_idx)
            if held:
                raise ValueError(f"a training forward (module.training with gradients enabled) attends to its own "
                                 f"tokens only, but layer {self.layer_idx}'s cache holds {held}: decode under "
                                 "torch.no_grad() / model.eval(), or pass no cache")
            return self._uncached(x, layout, want)  # no decoding cache built in training: nothing would read it
        if not self.is_causal:
            raise ValueError("a decoding cache needs a causal model; this layer attends in both directions")
        return self._cached(x, layout, cache, want, positions)

    def _uncached(self, x: Tensor, layout: MaskLayout, want: bool) -> tuple[Tensor, Tensor | None]:
        call = dict(is_causal=self.is_causal, need_weights=want, average_attn_weights=False)
        if layout.form == "packed":
            return self._packed(x, layout.segments, call)
        if layout.form == "general":
            m = layout.mask
            blocked = ~m if m.dtype == torch.bool else torch.where(m > torch.finfo(m.dtype).min / 2, m, float("-inf"))
            return self.attn(x, attn_mask=blocked.expand(-1, self.attn.num_heads, -1, -1), **call)
        padding = None if layout.valid is None else ~layout.valid
        return self.attn(x, key_padding_mask=padding, **call)

    def _packed(self, x: Tensor, segments: Tensor, call: dict) -> tuple[Tensor, Tensor | None]:
        """Each packed sequence attended on its own: gathered into a right-padded batch of one sequence per row
        (positions from 0 for the per-position priors, the rotary angles the model gave each token), one call."""
        B, L = segments.shape
        plan = _unpack_plan(segments)
        position = self._position
        if position is not None:
            self._position = tuple(_to_sequences(t.expand(B, L, t.shape[-1]), plan) for t in position)
        starts = torch.arange(plan.width, device=x.device)
        padding = starts >= plan.lengths.unsqueeze(1)
        try:
            out, weights = self.attn(_to_sequences(x, plan), key_padding_mask=padding if bool(padding.any()) else None,
                                     **call)
        finally:
            self._position = position
        return _from_sequences(out, plan, B, L), None if weights is None else _weights_back(weights, plan)

    def _cached(self, x: Tensor, layout: MaskLayout, cache, want: bool, positions=None) -> tuple[Tensor, Tensor | None]:
        B, L = x.shape[:2]
        layer = mgk_layer(cache, self.layer_idx, self.attn)
        first = layer.mgk_cache.length == 0
        if not first and layer.mgk_cache.batch_size != B:  # before any check that reads the rows
            raise ValueError(f"past_key_values: layer {self.layer_idx}'s cache was filled for a batch of "
                             f"{layer.mgk_cache.batch_size} rows, this call has batch size {B}; a cache serves the "
                             "rows it was filled with: for another batch pass a new DynamicCache, cache.reset() or "
                             "none")
        if not first and layer.packed:
            raise ValueError(f"layer {self.layer_idx}'s cache was filled by a packed forward (several sequences in "
                             "one row, told apart by position_ids or cu_seq_lens): a step would attend across them; "
                             "decode each sequence in its own row, or pass use_cache=False to the packed forward")
        if not first and L > 1 and isinstance(positions, Tensor):
            _check_continues(layer.mgk_cache.seen, positions, layout, self.layer_idx)
        if not first and (layout.form != "plain" or want):
            why = ("output_attentions needs maps over the whole cache, which mgk's caches do not form" if want
                   else "after its first call a cache takes masks of causality and padding only")
            raise ValueError(f"{why}: pass use_cache=False")
        valid = None if layout.valid is None else layout.valid[:, -L:]
        padding = None if valid is None or bool(valid.all()) else ~valid
        cached = dict(key_padding_mask=padding, is_causal=True, need_weights=False, past_key_values=layer.mgk_cache)
        if first:
            layer.packed = layout.form == "packed"
        if first and (torch.is_grad_enabled() or want or layout.form != "plain"):
            out = self._uncached(x, layout, want)  # exact (gradients, maps, packed sequences): the cache besides
            with torch.no_grad():
                self.attn(x, **cached)
            return out
        return self.attn(x, **cached)[0], None

    @property
    def rotary(self) -> bool:
        """Whether the query and keys are rotated (the model has rotary embeddings)."""
        return self._rotary is not None

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, causal={self.is_causal}, rotary={self.rotary}"


def _check_continues(seen: Tensor | None, positions: Tensor, layout: MaskLayout, layer_idx) -> None:
    """ValueError in one line when a chunk of a later cached call holds position 0 in a row whose cache holds real
    tokens: a new sequence (a packed row cut at a chunk boundary, or at a restart inside the chunk), which would
    attend to the sequence cached. Chunks only (L > 1): a decoding step costs no device read."""
    if seen is None or positions.dim() != 2 or positions.shape[0] not in (1, seen.shape[0]):
        return
    real = positions == 0
    if layout.valid is not None:
        real = real & layout.valid[:, -positions.shape[1]:].to(real.device)
    if bool((real & (seen.to(real.device) > 0)[:, None]).any()):
        raise ValueError(f"position_ids restart at 0 in a call on layer {layer_idx}'s cache, which holds tokens of "
                         "that row: a new sequence would attend to the one cached; give each sequence its own cache "
                         "or row, or pass use_cache=False")


def _held(cache, layer_idx: int | None) -> int:
    """Tokens layer ``layer_idx`` of the transformers ``cache`` holds (0 for a slot not made yet)."""
    layers = getattr(cache, "layers", None) or []
    if layer_idx is None or layer_idx >= len(layers):
        return 0
    return int(layers[layer_idx].get_seq_length())
