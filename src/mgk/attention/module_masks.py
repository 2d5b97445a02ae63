"""Module-level masks with ``nn.MultiheadAttention``'s semantics, split into what the functional core takes.

``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``, which convert bool
masks to float with ``-inf`` before calling their attention) reads a bool mask as True = not allowed and a float
mask as a bias added to the attention logits (torch.nn.MultiheadAttention documentation, ``attn_mask`` and
``key_padding_mask``). The functional core is bool-only (True = may attend), so a float mask is split here into
its ``-inf`` entries (not allowed, a bool mask) and its finite entries (a bias, None when they are all zero).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..functional.masks import MaskError, causal_mask
from .cache import token_positions


def _split_one(mask, name: str, bias_ok: bool, owner: str, why: str):
    """(bool mask True = not allowed, or the input unchanged when not float; finite float bias or None)."""
    if not isinstance(mask, Tensor) or not mask.is_floating_point():
        return mask, None  # bool passes; other dtypes are refused with the argument's name downstream
    blocked = torch.isneginf(mask)
    bias = torch.where(blocked, torch.zeros((), dtype=mask.dtype, device=mask.device), mask)
    invalid = f"float {name} must hold finite values or -inf (not allowed), got NaN or +inf"
    no_bias = f"{owner} takes a float {name} only as 0 (allowed) or -inf (not allowed): {why}; pass a bool mask " \
              "(True = not allowed)"
    if torch.compiler.is_compiling() or mask.device.type != "cpu":
        # Reading the values on the host would break a torch.compile graph (torch's Transformer layers pass every
        # padding mask as float) or synchronise an accelerator: check on the device, keep the bias as a tensor.
        torch._assert_async(torch.all(mask < float("inf")), invalid)
        if not bias_ok:
            torch._assert_async(torch.all(bias == 0), no_bias)
        return blocked, (bias if bias_ok else None)
    if not bool(torch.all(mask < float("inf"))):  # NaN fails the comparison too
        raise MaskError(invalid)
    if not bool(bias.any()):
        return blocked, None
    if not bias_ok:
        raise MaskError(no_bias)
    return blocked, bias


def _bias_4d(bias: Tensor, B: int, H: int, L: int, S: int, name: str) -> Tensor:
    shape = tuple(bias.shape)
    if name == "key_padding_mask" and shape == (B, S):
        return bias.view(B, 1, 1, S)
    if shape == (L, S):
        return bias.view(1, 1, L, S)
    if shape == (B * H, L, S):
        return bias.view(B, H, L, S)
    if shape == (B, H, L, S):
        return bias
    raise MaskError(f"{name} of shape {shape} does not fit (B, S), (L, S), (B*num_heads, L, S) or "
                    f"(B, num_heads, L, S) with B={B}, L={L}, S={S}, num_heads={H}")


LINEAR_NO_BIAS = "linear attention forms no logits to add a bias to"


def split_masks(key_padding_mask, attn_mask, B: int, H: int, L: int, S: int, *, bias_ok: bool, owner: str,
                why: str = LINEAR_NO_BIAS):
    """Split ``nn.MultiheadAttention``-style masks into bool masks (True = not allowed) and one float bias.

    Args:
        key_padding_mask: bool (B, S), True = padding; or float (B, S) added to the logits (-inf = padding).
        attn_mask: bool or float (L, S), (B * H, L, S) or (B, H, L, S), same semantics.
        bias_ok: whether the caller can add a bias (softmax, MGK); otherwise finite non-zero values raise.
        why: the reason the error gives when ``bias_ok`` is False (default: the linear kinds' reason).
    Returns:
        ``(key_padding_mask, attn_mask, bias)``: the masks bool (or unchanged when neither bool nor float, so that
        the caller's checks name them), and the bias broadcastable to (B, H, L, S) in float, or None.
    Raises:
        MaskError naming the argument for NaN / +inf entries, or bias values the caller cannot take.
    """
    key_padding_mask, kb = _split_one(key_padding_mask, "key_padding_mask", bias_ok, owner, why)
    attn_mask, ab = _split_one(attn_mask, "attn_mask", bias_ok, owner, why)
    parts = [_bias_4d(b, B, H, L, S, n) for b, n in ((kb, "key_padding_mask"), (ab, "attn_mask")) if b is not None]
    bias = None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return key_padding_mask, attn_mask, bias


def is_causal_mask(attn_mask: Tensor | None, L: int, S: int) -> bool:
    """Whether a bool (L, S) mask (True = not allowed) is exactly the bottom-right causal mask (``j > i + S - L``
    blocked; for L == S torch's ``nn.Transformer.generate_square_subsequent_mask``)."""
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (L, S):
        return False
    return bool(torch.equal(attn_mask, ~causal_mask(L, S, attn_mask.device)))


def causal_hint(attn_mask, is_causal: bool, L: int, S: int):
    """``(None, True)`` when ``attn_mask`` (bool, True = not allowed) is exactly the bottom-right causal mask
    (:func:`is_causal_mask`), else ``(attn_mask, is_causal)`` unchanged. torch's Transformer layers pass the causal
    mask itself (as float, which :func:`split_masks` makes bool), with or without the ``is_causal`` hint
    (pytorch ``nn.TransformerEncoderLayer.forward``); as ``is_causal`` every kind runs its causal path, the same
    outputs without an explicit (L, S) mask."""
    if is_causal_mask(attn_mask, L, S):
        return None, True
    return attn_mask, is_causal


def shifts_positions(key_padding_mask: Tensor) -> bool:
    """Whether some row of ``key_padding_mask`` (B, S) (bool True = padding, or float with -inf = padding) has a
    padding key before a real one, so that :func:`key_positions` differs from 0..S-1 at a real key."""
    pad = key_padding_mask if key_padding_mask.dtype == torch.bool else torch.isneginf(key_padding_mask)
    return bool((pad[:, :-1] & ~pad[:, 1:]).any())


def key_positions(key_padding_mask: Tensor) -> Tensor:
    """(B, S) int64 positions of the keys of each row, counted from its first real key (the rule of the decoding
    cache, :func:`mgk.attention.cache.token_positions`): ``key_padding_mask`` (B, S) bool True = padding, or float
    with -inf = padding. A padding key gets the position of the next real one (nothing attends to it)."""
    pad = key_padding_mask if key_padding_mask.dtype == torch.bool else torch.isneginf(key_padding_mask)
    seen = torch.zeros(pad.shape[0], dtype=torch.int64, device=pad.device)
    return token_positions(seen, ~pad, pad.shape[1])
