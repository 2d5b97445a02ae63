"""Autoregressive generation from a causal LM with a decoding cache (``TransformerLM.generate``).

The prompt is prefilled in one call through the model's :class:`~mgk.attention.cache.DecodingCache`; each further
token is one call on that token alone, so a step costs the new token's projections and one read of each layer's
cache (its keys and values, or a linear layer's fixed state) instead of the whole prefix. ``use_cache=False``
recomputes the whole sequence at every step instead (the reference: the same numbers, slower).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .compiled_decode import CompiledStep, check_compile
from .sampling import check_sampling, next_token

__all__ = ["generate"]


def _prompt_padding(idx: Tensor, key_padding_mask: Tensor | None) -> Tensor | None:
    """The checked left padding of the prompt (None when none). ValueError naming the argument."""
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32) \
            or idx.shape[1] < 1:
        what = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, Tensor) else type(idx).__name__
        raise ValueError(f"idx must be an integer tensor (B, T) of prompt tokens with T >= 1, got {what}")
    if key_padding_mask is None:
        return None
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool \
            or key_padding_mask.shape != idx.shape:
        what = (f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}" if isinstance(key_padding_mask, Tensor)
                else type(key_padding_mask).__name__)
        raise ValueError(f"key_padding_mask must be bool of idx's shape {tuple(idx.shape)} (True = padding), got "
                         f"{what}")
    if bool((~key_padding_mask[:, :-1] & key_padding_mask[:, 1:]).any()):
        raise ValueError("key_padding_mask must pad prompts on the left (each row's real tokens at its end, so that "
                         "the continuation follows them)")
    if bool(key_padding_mask.all(dim=1).any()):
        raise ValueError("key_padding_mask leaves a row without a real prompt token")
    return key_padding_mask if bool(key_padding_mask.any()) else None


def _check_decodable(model, T: int, max_new_tokens: int, use_cache: bool) -> None:
    """ValueError (one line naming the option and its limit) when the model cannot decode that far."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    limit = model.position_limit()
    need = T + max_new_tokens - 1  # positions the model reads: the last sampled token is not fed back
    if limit is not None and need > limit[1]:
        raise ValueError(f"{limit[0]} has mixture weights for max_len={limit[1]} positions (the trained length): "
                         f"a prompt of {T} tokens plus max_new_tokens={max_new_tokens} needs {need}")
    if use_cache and any(getattr(block.attn, "normalize", None) == "length" for block in model.blocks):
        raise ValueError("normalize='length' scales every position by the whole sequence's length, so the earlier "
                         "outputs of a layer change as the sequence grows and no cache serves a stack of layers: "
                         "pass use_cache=False (mgk generate: --no-cache)")


def _ready_to_fix(model, cache) -> bool:
    """Whether every layer's kind lets its cache be fixed now for the compiled step (its module's
    ``cache_ready_to_fix``: after the prefill; MGK once its centre is settled)."""
    return all(block.attn.cache_ready_to_fix(layer) for block, layer in zip(model.blocks, cache))


def _continue(model, out: Tensor, pad: Tensor | None, cache, use_cache: bool) -> Tensor:
    """Log-probabilities of the token after ``out`` (B, T'): one step through ``cache`` with the last token, or
    (``use_cache=False``) the whole sequence recomputed."""
    if use_cache:
        return model.next_log_probs(out[:, -1:], past_key_values=cache)
    if pad is not None:
        pad = torch.cat([pad, pad.new_zeros(pad.shape[0], out.shape[1] - pad.shape[1])], dim=1)
    return model.next_log_probs(out, key_padding_mask=pad, past_key_values=model.new_cache(out.shape[1]))


@torch.no_grad()
def generate(model, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True, key_padding_mask: Tensor | None = None, compile: bool | str = False) -> Tensor:
    """Continue the prompts ``idx`` by up to ``max_new_tokens`` tokens each.

    Runs under ``torch.no_grad`` in eval mode (the model's mode is restored after). Each token is drawn by
    :func:`mgk.models.sampling.next_token` from the next-token log-probabilities: greedy (argmax) at
    ``temperature=0``, else ``softmax(log p / temperature)`` restricted to the ``top_k`` most likely tokens and to
    the nucleus of mass ``top_p``, drawn with ``generator`` (seed it for reproducible samples).

    Args:
        idx: (B, T) int64 prompt tokens (at least one real token per row).
        key_padding_mask: (B, T) bool, True = padding, for prompts of different lengths padded on the *left*; each
            row's positions start at its first real token, so it continues as it would alone.
        eos: a token id that ends a row: once drawn, the row's later tokens are ``eos`` as well, and generation
            stops when every row has ended.
        use_cache: decode through the model's cache (default); False recomputes the whole sequence at every step.
        compile: True (inductor) or a torch.compile backend name: once every layer's kind lets its cache be fixed
            (``cache_ready_to_fix``: after the prefill; MGK once every row has seen two real tokens, its centre
            then settled), each step runs one compiled graph over caches fixed at the tokens the generation will
            reach (:mod:`mgk.models.compiled_decode`; the first compiled step includes the compilation, seconds to a
            minute). The tokens equal eager decoding's up to the compiler's rounding (greedy: token for token in the
            tests). False (default): eager.
    Returns:
        (B, T + n) int64: the prompt followed by its continuation, as nanoGPT's ``generate`` returns it; n =
        ``max_new_tokens``, or fewer when every row has reached ``eos``.
    Raises:
        ValueError naming the argument for bad values, and in one line when the model cannot decode that far
        (per-position mixture weights: their option and max_len) or through a cache (normalize="length"), and
        naming ``log_probs`` when the model's next-token scores are not finite (:func:`mgk.models.sampling.next_token`).
    """
    pad = _prompt_padding(idx, key_padding_mask)
    backend = check_compile(compile)
    if backend is not None and not use_cache:
        raise ValueError("compile compiles the cached step: it needs use_cache=True")
    check_sampling(temperature, top_k, top_p, generator)
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < model.vocab_size):
        raise ValueError(f"eos must be None or a token id in [0, {model.vocab_size}), got {eos!r}")
    if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < model.vocab_size:
        # the embedding would fail deep inside torch ("index out of range in self"), naming nothing
        raise ValueError(f"idx must hold token ids in [0, {model.vocab_size}) (padding positions included), got "
                         f"ids from {int(idx.min())} to {int(idx.max())}")
    T = idx.shape[1] if pad is None else int((~pad).sum(dim=1).max())
    _check_decodable(model, T, max_new_tokens, use_cache)
    was_training = model.training
    model.eval()
    try:
        out = idx.long()
        if max_new_tokens == 0:
            return out
        # No room reserved for max_new_tokens: the slot caches take the prompt at the first call and double as
        # tokens come, so an early eos (or a large max_new_tokens) costs memory for the tokens made, not the bound.
        cache = model.new_cache()
        log_probs = model.next_log_probs(out, key_padding_mask=pad, past_key_values=cache)
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        compiled = None
        for step in range(max_new_tokens):
            token = next_token(log_probs, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if eos is not None:
                token = torch.where(done, torch.full_like(token, eos), token)
                done = done | (token == eos)
            out = torch.cat([out, token.unsqueeze(1)], dim=1)
            if step == max_new_tokens - 1 or (eos is not None and bool(done.all())):
                break
            if backend is not None and compiled is None and _ready_to_fix(model, cache):
                # the calls left: this one and one per token after it but the last (which is not fed back)
                compiled = CompiledStep(model, cache, cache[0].length + max_new_tokens - 1 - step, backend)
            log_probs = compiled(out[:, -1:]) if compiled is not None else _continue(model, out, pad, cache, use_cache)
        return out
    finally:
        model.train(was_training)
