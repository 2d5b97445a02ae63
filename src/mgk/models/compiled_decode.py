"""``generate(..., compile=True)``: the one-token decoding step of a :class:`~mgk.models.TransformerLM`, compiled
once by ``torch.compile`` over a cache of fixed capacity (gpt-fast's static cache, HF's ``cache_implementation=
"static"``).

The eager step (:meth:`TransformerLM.next_log_probs` through a growing cache) reads only the slots in use, and its
shapes change every token, so a compiler would trace it anew at each one. Here every layer's cache is fixed at the
tokens the generation will reach (:meth:`mgk.attention.cache.LayerCache.fix_capacity`): a step writes one token at a
slot held as a tensor and reads the whole capacity with the valid-slot mask, reads no host-side count, and the traced
graph (the blocks and the output layer, :meth:`TransformerLM.log_probs_from_inputs`) serves every step. The
embedding (its token-id check reads values) and the positions run eagerly before it; the host counts are advanced
after it. MGK / sMGK steps keep the C++ kernel as the custom op ``mgk::cache_step_at`` for caches of at least
:data:`mgk.functional.mgk_cache.TRACED_EXPLICIT_BYTES` of keys a layer, and below that trace the step's explicit
composition, which inductor fuses with the rest.

The graph is specialised to its shapes (``dynamic=False``: symbolic sizes made the mask checks fail to trace): a new
batch size, capacity or model compiles again, and past torch.compile's recompilation limit (8 per function by
default, ``torch._dynamo.config.recompile_limit``) the steps of that generation run eagerly, with a warning. What
it pays on CPU was measured, not assumed (BENCHMARKS.md, "Compiled decoding"); the first step includes the
compilation, which ``mgk bench decode --compile`` reports apart.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ..attention.cache import DecodingCache

__all__ = ["CompileError", "CompiledStep", "check_compile"]

_COMPILED: dict[str, object] = {}  # one compiled function per backend: its guards tell models and shapes apart


class CompileError(RuntimeError):
    """torch.compile failed on the decoding step (e.g. inductor found no C++ compiler): one line naming the option,
    the compiler's own error chained."""


def check_compile(compile) -> str | None:
    """The torch.compile backend that ``compile`` asks for: None for False, "inductor" for True, a backend name as
    given (e.g. "aot_eager", which traces without generating code). ValueError naming ``compile`` otherwise."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile in torch.compiler.list_backends(exclude_tags=()):
        return compile
    raise ValueError(f"compile must be False, True (inductor) or a torch.compile backend name from "
                     f"{sorted(torch.compiler.list_backends(exclude_tags=()))}, got {compile!r}")


def _log_probs(model, x: Tensor, cache: DecodingCache) -> Tensor:
    return model.log_probs_from_inputs(x, cache)


class CompiledStep:
    """The compiled one-token step of ``model`` over ``cache`` (filled by the prefill), fixed at ``capacity`` tokens.

    Args:
        model: a :class:`~mgk.models.TransformerLM` in eval mode.
        cache: its :class:`~mgk.attention.cache.DecodingCache` after the prefill; every layer's kind must let its
            cache be fixed (its module's ``cache_ready_to_fix``: MGK once each row has seen two real tokens).
        capacity: the tokens every layer's cache will reach (the tokens seen plus the steps to come).
        backend: a torch.compile backend (:func:`check_compile`).
    Calling it with the new tokens (B, 1) int64 returns their next-token log-probabilities (B, V), equal to
    ``model.next_log_probs(tokens, past_key_values=cache)`` up to the compiler's rounding.
    Raises:
        ValueError naming ``capacity`` when it cannot hold the tokens seen, naming ``cache`` when a layer's kind does
        not let it be fixed yet, and in a call when the capacity is used up; :class:`CompileError` (a RuntimeError)
        in one line when torch.compile fails (e.g. inductor finds no C++ compiler).
    """

    def __init__(self, model, cache: DecodingCache, capacity: int, backend: str = "inductor"):
        for i, (block, layer) in enumerate(zip(model.blocks, cache)):
            if not block.attn.cache_ready_to_fix(layer):
                raise ValueError(f"cache: layer {i}'s {type(block.attn).__name__} does not let its cache be fixed yet "
                                 "(cache_ready_to_fix: MGK needs every row to have seen two real tokens)")
        for layer in cache:
            layer.fix_capacity(capacity)
        self.model, self.cache, self.backend = model, cache, backend
        if backend not in _COMPILED:
            _COMPILED[backend] = torch.compile(_log_probs, backend=backend, fullgraph=True, dynamic=False)
        self._fn = _COMPILED[backend]

    def __call__(self, tokens: Tensor) -> Tensor:
        room = self.cache[0].room() if len(self.cache) else None
        if room is not None and room < tokens.shape[1]:
            raise ValueError(f"the cache's fixed capacity ({self.cache[0].capacity} tokens) is used up")
        x = self.model.decode_inputs(tokens, self.cache)
        try:
            out = self._fn(self.model, x, self.cache)
        except ValueError:  # our own checks, already one line
            raise
        except Exception as exc:  # the compiler's failure, many lines deep: one line naming the option
            if type(exc).__name__ != "FailOnRecompileLimitHit":
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                raise CompileError(f"compile={self.backend!r}: torch.compile failed ({type(exc).__name__}: "
                                   f"{' '.join(lines[:2])}); generate with compile=False") from exc
            # torch refused a new graph before running anything: this generation goes on eagerly
            warnings.warn(f"compile={self.backend!r}: torch.compile's recompilation limit "
                          f"({torch._dynamo.config.recompile_limit} shapes or models per process) is reached; "
                          "this generation decodes eagerly", stacklevel=3)
            self._fn = _log_probs
            out = self._fn(self.model, x, self.cache)
        for layer in self.cache:
            layer.advance(tokens.shape[1])
        return out
