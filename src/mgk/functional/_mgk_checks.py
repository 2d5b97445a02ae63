"""The argument checks of MGK's cached ops (:mod:`.mgk_cache`), each a ValueError in one line naming the argument.

Grouped keys: a cache's entries have G heads (key groups) and the queries H, a multiple of G (query head h reads
group h // (H / G)); G = H is MGK itself."""
from __future__ import annotations

import torch

from . import masks as _masks
from ._checks import check_same, check_tensor
from ._mixture_terms import check_components, check_mixture_args, check_shifts


def check_groups(query_heads: int, name: str, heads: int) -> None:
    """ValueError naming ``name`` unless its ``heads`` (the cache's key groups G) divide the query's heads H."""
    if heads < 1 or query_heads % heads:
        raise ValueError(f"{name} must have a number of heads (key groups G) dividing query's {query_heads} heads "
                         f"(query head h reads group h // (H / G)), got {heads}")


def check_attention(query, keys, key_bias, value, shifts, mixture, attn_mask):
    """The operands of :func:`mgk.functional.mgk_attention_cached`; returns
    ``(B, H, G, L, S, M, D, shifts, mask)``."""
    check_tensor(query, "query", 4, "(B, H, L, D)")
    shifted = shifts is not None
    check_tensor(keys, "keys", 4 if shifted else 5, "(B, G, S, D) with shifts" if shifted else "(B, G, M, S, D)")
    check_tensor(value, "value", 4, "(B, G, S, Dv)")
    check_tensor(key_bias, "key_bias", 4, "(B, G, M, S)")
    B, H, L, D = query.shape
    G = keys.shape[1]
    S = keys.shape[-2]
    check_groups(H, "keys", G)
    for name, t in (("keys", keys), ("key_bias", key_bias), ("value", value)):
        check_same("query", B, name, t.shape[0], "batch size")
        check_same("keys", G, name, t.shape[1], "number of heads")
    check_same("query", D, "keys", keys.shape[-1], "head_dim")
    check_same("keys", S, "value", value.shape[2], "key length S")
    check_same("keys", S, "key_bias", key_bias.shape[-1], "key length S")
    M = key_bias.shape[2]
    check_components(M, "key_bias")
    if not shifted:
        check_same("keys", keys.shape[2], "key_bias", M, "mixture components M")
    check_mixture_args(mixture, None)
    return (B, H, G, L, S, M, D, check_shifts(shifts, M, G, D),
            _masks.check_mask(attn_mask, "attn_mask", B, H, L, S))


def check_backend(backend, backends: tuple[str, ...]) -> None:
    """ValueError naming ``backend`` unless it is None or one of ``backends``."""
    if backend is not None and backend not in backends:
        raise ValueError(f"backend must be None or one of {backends}, got {backend!r}")


def check_step(query, key, value, keys, key_bias, values, shifts) -> int:
    """:func:`mgk.functional.mgk_cache_step`'s operands: ranks, sizes against each other, the shifts, buffers that
    own their memory (written in place). Returns M."""
    shifted = shifts is not None
    check_tensor(query, "query", 4, "(B, H, L, D)")
    check_tensor(key, "key", 4 if shifted else 5, "(B, G, L, D) with shifts" if shifted else "(B, G, M, L, D)")
    check_tensor(value, "value", 4, "(B, G, L, Dv)")
    check_tensor(keys, "keys", 4 if shifted else 5, "(B, G, T, D) with shifts" if shifted else "(B, G, M, T, D)")
    check_tensor(key_bias, "key_bias", 4, "(B, G, M, T)")
    check_tensor(values, "values", 4, "(B, G, T, Dv)")
    M = _check_step_sizes(query, key, value, keys, key_bias, values, shifted)
    check_shifts(shifts, M, keys.shape[1], query.shape[3])
    for name, buf in (("keys", keys), ("key_bias", key_bias), ("values", values)):
        if any(st == 0 and n > 1 for st, n in zip(buf.stride(), buf.shape)):
            raise ValueError(f"{name} must be a buffer that owns its memory (written in place), not an expanded "
                             f"view (stride 0 in {tuple(buf.stride())})")
    return M


def _check_step_sizes(query, key, value, keys, key_bias, values, shifted: bool) -> int:
    """The sizes of a step's operands against each other (ValueError naming the two that differ); returns M."""
    B, H, L, D = query.shape
    M, G = key_bias.shape[2], keys.shape[1]
    check_groups(H, "keys", G)
    for name, t in (("key", key), ("value", value), ("keys", keys), ("key_bias", key_bias), ("values", values)):
        check_same("query", B, name, t.shape[0], "batch size")
        check_same("keys", G, name, t.shape[1], "number of heads")
    check_same("query", L, "key", key.shape[-2], "new tokens L")
    check_same("query", L, "value", value.shape[2], "new tokens L")
    check_same("query", D, "key", key.shape[-1], "head_dim")
    check_same("query", D, "keys", keys.shape[-1], "head_dim")
    check_same("value", value.shape[-1], "values", values.shape[-1], "value size Dv")
    check_same("keys", keys.shape[-2], "key_bias", key_bias.shape[-1], "slots T")
    check_same("keys", keys.shape[-2], "values", values.shape[2], "slots T")
    if not shifted:
        check_same("key", key.shape[2], "key_bias", M, "mixture components M")
        check_same("keys", keys.shape[2], "key_bias", M, "mixture components M")
    check_components(M, "key_bias")
    return M


def check_slots(slot, key_valid, B: int, L: int, T: int) -> tuple[int, torch.Tensor | None]:
    """The slot and key_valid of a step (ValueError naming them); returns the slots the step reads, S, and the
    key-padding mask (B, 1, 1, S) or None: ``[0, slot + L)`` for an int slot, every slot for a slot tensor."""
    if isinstance(slot, torch.Tensor):
        _check_slot_tensor(slot, L, T, key_valid, B)
        return T, key_valid[:, None, None, :]
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0 or slot + L > T:
        raise ValueError(f"slot must be an int with 0 <= slot and slot + L <= T (the buffers' {T} slots) for L = {L} "
                         f"new tokens, got {slot!r}")
    S = slot + L
    if key_valid is not None and (not isinstance(key_valid, torch.Tensor) or key_valid.dtype != torch.bool
                                  or tuple(key_valid.shape) != (B, S)):
        what = (tuple(key_valid.shape), key_valid.dtype) if isinstance(key_valid, torch.Tensor) else type(key_valid)
        raise ValueError(f"key_valid must be a bool tensor (B, slot + L) = ({B}, {S}), got {what}")
    return S, None if key_valid is None else key_valid[:, None, None, :]


def _check_slot_tensor(slot: torch.Tensor, L: int, T: int, key_valid, B: int) -> None:
    """A slot tensor's rules (a cache of fixed capacity): (1,) int64, one new token, in range (read on the host
    outside a trace), key_valid (B, T) over every slot."""
    if not (slot.dtype == torch.int64 and tuple(slot.shape) == (1,)):
        raise ValueError(f"slot must be an int or a (1,) int64 tensor, got {slot.dtype} {tuple(slot.shape)}")
    if L != 1:
        raise ValueError(f"a slot tensor takes one new token a step, got L = {L}")
    if not torch.compiler.is_compiling() and not 0 <= int(slot) <= T - L:
        raise ValueError(f"slot must be in [0, T - L] = [0, {T - L}] (the buffers' {T} slots, L = {L}), got "
                         f"{int(slot)}")
    if not (isinstance(key_valid, torch.Tensor) and key_valid.dtype == torch.bool
            and tuple(key_valid.shape) == (B, T)):
        what = (tuple(key_valid.shape), key_valid.dtype) if isinstance(key_valid, torch.Tensor) else type(key_valid)
        raise ValueError(f"key_valid must be a bool tensor (B, T) = ({B}, {T}) over every slot when slot is a "
                         f"tensor, got {what}")


def refuse_graph(key, value, prior, terms, keys, key_bias, values) -> None:
    """ValueError naming the first of a step's stored operands that requires grad (called with grad enabled): the
    entries are made and written without a graph and the queries attend over the buffers, so a backward would reach
    the query alone and silently drop the rest. A few flag reads: this runs at every step."""
    for name, t in (("key", key), ("value", value), ("log_pi", prior), ("sigma2", terms.s2),
                    ("shifts", terms.shifts), ("keys", keys), ("key_bias", key_bias), ("values", values)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad: a cached MGK step stores its entries without a graph, so "
                             "gradients through them would be lost; decode under torch.no_grad() or "
                             f"torch.inference_mode(), detach {name}, or call mgk_attention (exact gradients)")
