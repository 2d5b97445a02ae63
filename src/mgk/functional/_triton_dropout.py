"""Attention dropout for the Triton MGK kernels: the keep mask of the C++ CPU kernel, computed inside Triton.

The keep decision of (slice bh = b * H + h, query i, key j) is a hash of (seed, offset, bh, i, j) alone, the same
hash as ``csrc/mixture_flash.cpp`` (``dropout_row_key`` and ``dropout_row``): a counter-based stream (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; flash-attention uses Philox the same way), so backward
regenerates the forward's mask without storing it and the mask does not depend on the block sizes. The row key is

    key_i = splitmix64(seed ^ splitmix64(offset + (bh * L + i) * 0x9e3779b97f4a7c15))     (uint64 arithmetic)

(SplitMix64, Steele et al., OOPSLA 2014), and key j is kept iff

    fmix32(fmix32(uint32(j) * 0x9e3779b9 ^ lo(key_i)) ^ hi(key_i)) >= round(p * 2^32)

(two rounds of MurmurHash3's 32-bit finaliser, uint32 arithmetic). Kept weights are scaled by 1 / (1 - p). For the
same (seed, offset) both backends therefore drop the same weights, and :func:`dropout_mask` here equals
``_mixture_flash.dropout_mask``.

The (seed, offset) pair lives in a (2,) int64 tensor on the inputs' device, drawn from torch's generator of that
device (``_mixture_flash.draw_dropout_seed_tensor``, the CPU kernel's draw too), and is read by the kernels: no host
synchronisation on CUDA, and ``torch.manual_seed`` and saved generator states (exact resume, activation
checkpointing) control the mask.
"""
from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs do not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def threshold(p: float) -> int:
    """The keep threshold ``round(p * 2^32)`` of the C++ kernel (``std::llround``: halves away from zero)."""
    x = float(p) * 4294967296.0
    return int(x + 0.5)  # x >= 0


if triton is not None:

    @triton.jit
    def _fmix32(h):
        """MurmurHash3's 32-bit finaliser on uint32 values (wrapping multiplication, logical shifts)."""
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _splitmix64(z):
        """SplitMix64's output function on uint64 values."""
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def keep_factor(Seed, bh, offs_m, offs_n, L, thresh, scale):
        """(BLOCK_M, BLOCK_N) float32: ``scale`` where (bh, offs_m, offs_n) is kept, 0 where it is dropped."""
        seed = tl.load(Seed).to(tl.uint64, bitcast=True)
        offset = tl.load(Seed + 1).to(tl.uint64, bitcast=True)
        row = (bh.to(tl.int64) * L + offs_m).to(tl.uint64)
        key = _splitmix64(seed ^ _splitmix64(offset + row * 0x9E3779B97F4A7C15))
        lo = key.to(tl.uint32)
        hi = (key >> 32).to(tl.uint32)
        h = _fmix32(_fmix32(offs_n.to(tl.uint32)[None, :] * 0x9E3779B9 ^ lo[:, None]) ^ hi[:, None])
        # h < 2^32 fits int64; thresh may arrive as int32, int64 or (when 1) a constexpr
        return tl.where(h.to(tl.uint64).to(tl.int64) >= thresh, scale, 0.0)

    @triton.jit
    def _mask_kernel(Seed, Keep, L, S, thresh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        z = keep_factor(Seed, bh, offs_m, offs_n, L, thresh, 1.0)
        ok = (offs_m[:, None] < L) & (offs_n[None, :] < S)
        tl.store(Keep + (bh * L + offs_m[:, None]) * S + offs_n[None, :], (z > 0).to(tl.int8), mask=ok)


def dropout_mask(seed: int, offset: int, B: int, H: int, L: int, S: int, p: float,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The keep mask (B, H, L, S) bool that the Triton kernels apply for ``(seed, offset)`` and drop probability
    ``p`` (equal to ``_mixture_flash.dropout_mask``). Runs on ``device`` (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). For tests."""
    seeds = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    keep = torch.empty(B * H, L, S, dtype=torch.int8, device=device)
    grid = (triton.cdiv(L, 32), triton.cdiv(S, 32), B * H)
    _mask_kernel[grid](seeds, keep, L, S, threshold(p), BLOCK_M=32, BLOCK_N=32)
    return keep.bool().view(B, H, L, S)
