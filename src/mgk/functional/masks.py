"""Mask conventions shared by every attention function.

Inside the functional core a mask is a boolean tensor broadcastable to (B, H, L, S) in which True means
"this query may attend to this key" (the convention of ``torch.nn.functional.scaled_dot_product_attention``).
Modules convert the ``nn.MultiheadAttention`` convention (True = padding / not allowed) once at their boundary
(see :func:`from_module_masks`).

Causal masks are aligned bottom-right: query i of L may see key j of S when ``j <= i + (S - L)``, so the last
query sees every key. This is what incremental decoding needs (one new query against a cache of S keys).
"""
from __future__ import annotations

import torch
from torch import Tensor


class MaskError(ValueError, TypeError):
    """A mask of the wrong dtype or shape. Subclasses both ValueError and TypeError so either may be caught."""


def causal_mask(L: int, S: int, device: torch.device | str | None = None) -> Tensor:
    """Bottom-right aligned causal mask.

    Returns a bool tensor of shape (L, S), True where query i may attend to key j, i.e. ``j <= i + S - L``.
    When L > S the first ``L - S`` rows see no key at all (attention functions return zeros there).
    """
    i = torch.arange(L, device=device).unsqueeze(1)
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i + (S - L)


def check_mask(mask: Tensor | None, name: str, B: int, H: int, L: int, S: int) -> Tensor | None:
    """Validate a functional-core mask: bool dtype, at most 4 dims, broadcastable to (B, H, L, S).

    Raises MaskError naming ``name`` when the dtype is not bool (a float 0/1 mask must never be taken silently
    as an additive bias) or when the shape does not broadcast.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise MaskError(f"{name} must be a torch.Tensor of dtype torch.bool, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise MaskError(
            f"{name} must have dtype torch.bool (True = may attend), got {mask.dtype}; "
            f"convert with `{name}.bool()` if it is a 0/1 mask (additive float masks are not accepted)"
        )
    if mask.dim() > 4:
        raise MaskError(f"{name} must have at most 4 dims broadcastable to (B, H, L, S) = "
                        f"{(B, H, L, S)}, got shape {tuple(mask.shape)}")
    target = (B, H, L, S)
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    for have, want in zip(shape, target):
        if have not in (1, want):
            raise MaskError(f"{name} of shape {tuple(mask.shape)} does not broadcast to (B, H, L, S) = {target}")
    return mask.reshape(shape)


def check_bias(bias: Tensor | None, name: str, B: int, H: int, L: int, S: int) -> Tensor | None:
    """Validate an additive score bias: a floating tensor with at most 4 dims broadcastable to (B, H, L, S).

    Returns it as 4 dims, or None. Values are finite or -inf (a pair that may not attend); NaN and +inf raise when
    they can be read without cost (CPU tensors outside a torch.compile trace; reading an accelerator's tensor would
    synchronise it on every call). Raises ValueError naming ``name``."""
    if bias is None:
        return None
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        what = bias.dtype if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"{name} must be a floating tensor broadcastable to (B, H, L, S) = {(B, H, L, S)}, "
                         f"got {what}")
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    if bias.dim() > 4 or any(have not in (1, want) for have, want in zip(shape, (B, H, L, S))):
        raise ValueError(f"{name} of shape {tuple(bias.shape)} does not broadcast to (B, H, L, S) = {(B, H, L, S)}")
    if bias.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(torch.all(bias < float("inf"))):
        raise ValueError(f"{name} must hold finite values or -inf (a pair that may not attend), got NaN or +inf")
    return bias.reshape(shape)


def fold_bias(mask: Tensor | None, bias: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Move the -inf entries of a checked bias into the bool mask (True = may attend), so that every backend meets a
    finite bias and masks pairs one way; returns ``(mask, bias)``."""
    if bias is None:
        return mask, None
    allowed = bias > float("-inf")
    bias = torch.where(allowed, bias, torch.zeros((), dtype=bias.dtype, device=bias.device))
    return (allowed if mask is None else mask & allowed), bias


def combine(attn_mask: Tensor | None, is_causal: bool, L: int, S: int, device) -> Tensor | None:
    """AND of a checked 4-dim bool mask and the bottom-right causal mask; None when neither is given."""
    if not is_causal:
        return attn_mask
    causal = causal_mask(L, S, device).view(1, 1, L, S)
    return causal if attn_mask is None else (attn_mask & causal)


def from_module_masks(key_padding_mask: Tensor | None, attn_mask: Tensor | None, B: int, L: int, S: int,
                      num_heads: int) -> Tensor | None:
    """Convert ``nn.MultiheadAttention``-style masks into one functional-core mask.

    Args:
        key_padding_mask: bool (B, S), True = padding (ignored key). None for no padding.
        attn_mask: bool (L, S) or (B * num_heads, L, S) or (B, num_heads, L, S), True = not allowed.
    Returns:
        bool mask broadcastable to (B, H, L, S), True = may attend; or None.
    Raises:
        MaskError naming the argument for non-bool dtypes or wrong shapes.
    """
    allowed = None
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            dt = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
            raise MaskError(f"key_padding_mask must be a bool tensor (True = padding), got {dt}")
        if tuple(key_padding_mask.shape) != (B, S):
            raise MaskError(f"key_padding_mask must have shape (B, S) = {(B, S)}, got {tuple(key_padding_mask.shape)}")
        allowed = (~key_padding_mask).view(B, 1, 1, S)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
            dt = getattr(attn_mask, "dtype", type(attn_mask).__name__)
            raise MaskError(f"attn_mask must be a bool tensor (True = not allowed), got {dt}; "
                            "float additive masks are not accepted")
        shape = tuple(attn_mask.shape)
        if shape == (L, S):
            am = (~attn_mask).view(1, 1, L, S)
        elif shape == (B * num_heads, L, S):
            am = (~attn_mask).view(B, num_heads, L, S)
        elif shape == (B, num_heads, L, S):
            am = ~attn_mask
        else:
            raise MaskError(f"attn_mask must have shape (L, S) = {(L, S)}, (B*num_heads, L, S) = "
                            f"{(B * num_heads, L, S)} or (B, num_heads, L, S); got {shape}")
        allowed = am if allowed is None else (allowed & am)
    return allowed


def prepare(mask: Tensor | None, key: Tensor, value: Tensor, query: Tensor | None = None):
    """Make masked content inert and find rows that can see no key.

    Keys and values that no query may attend to are replaced by zeros with ``torch.where`` (never by
    multiplication), so padded content that is 1e30 or NaN cannot leak through ``0 * inf``. Returns
    ``(safe_mask, key, value, empty_rows)`` where ``safe_mask`` has every fully masked query row switched to
    all-True (so softmax stays finite) and ``empty_rows`` (broadcastable to (B, H, L, 1), bool) marks those rows,
    whose outputs the caller sets to zero. ``key`` may carry an extra component dim before S (MGK keys are
    (B, H, M, S, D)). When ``query`` is given, the queries of empty rows are zeroed too and the result is
    ``(safe_mask, key, value, empty_rows, query)``: a NaN query there would otherwise give NaN scores whose
    softmax backward poisons the gradients of real keys, even though the row's output is cut to zero.
    """
    if mask is None:
        return (None, key, value, None) if query is None else (None, key, value, None, query)
    # Branch-free (no host sync, no graph break under torch.compile): the wheres are cheap next to attention.
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    dead = ~mask.any(dim=-2).unsqueeze(-1)  # (B?, H?, S, 1): no query may attend to this key
    value = torch.where(dead, zero, value)
    key = torch.where(dead if key.dim() == 4 else dead.unsqueeze(-3), zero.to(key.dtype), key)
    empty = ~mask.any(dim=-1, keepdim=True)  # (B?, H?, L, 1)
    if query is None:
        return mask | empty, key, value, empty
    query = torch.where(empty, zero.to(query.dtype), query)
    return mask | empty, key, value, empty, query


def zero_rows(out: Tensor, empty: Tensor | None) -> Tensor:
    """Set the output rows that could see no key to exactly zero (finite gradients: where, not multiply)."""
    if empty is None:
        return out
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)
