"""Linear attention (Katharopoulos et al. 2020) and attention with a mixture of linear keys (MLK, paper eq. 14).

With a feature map ``phi`` (default ``elu(x) + 1``, positive), query i, and key features ``phi~(k_j)``::

    o_i = phi(q_i)^T sum_j phi~(k_j) v_j^T / phi(q_i)^T sum_j phi~(k_j)

Linear attention uses ``phi~(k_j) = phi(k_j)``; MLK mixes the *features* of the M key components,
``phi~(k_j) = sum_r pi_jr phi(k_jr)`` (not the raw keys before phi, which collapses to one key projection).
The sums are taken over the keys query i may see: all unpadded keys, and in causal mode only ``j <= i + S - L``
(bottom-right alignment, :mod:`mgk.functional.masks`).

Masks: prefix sums cannot express an arbitrary (L, S) mask, so ``attn_mask`` may only mark padded keys (shape
broadcastable to (B, H, 1, S), True = real key); causality is ``is_causal``. Padded keys are removed with
``torch.where`` on the raw keys and again on the features and values (``elu(0) + 1 = 1``, so zeroing a key is not
enough, and NaN/1e30 padding must never meet a multiplication). Query rows that can see no key are removed the same
way (their content cannot reach any gradient) and return exactly zero.

Two implementations (``backend=``) compute the same numbers; :func:`select_linear_backend` picks one:

* "chunked": non-causal, the (B, H, D', Dv) state ``sum_j phi~(k_j) v_j^T`` and the (B, H, D') normaliser, O(L + S)
  memory; causal, chunked prefix sums: inside a chunk of c positions an explicit masked (c x c) quadratic form,
  across chunks an exclusive cumulative sum of per-chunk states (B, H, L / c, D', Dv). Never an L x D' x Dv tensor;
* "explicit": the (B, H, L, S) normalised weights and their product with v (the only one that returns weights).

By default ``eps`` replaces only a denominator that is exactly zero (a row whose visible keys all have zero
features), so every other row is normalised exactly: constant values give that constant (Katharopoulos et al. add
eps to every denominator, which biases each output toward 0 by den / (den + eps); ``eps_mode="add"`` does that).

Options select the other forms of the Transformer-MGK authors' released code (``normalize``, ``feature_map``,
``output_scale``, ``eps_mode``, ``mix``; see :mod:`mgk.functional._linear_forms`).

Sums and denominators run in float32 (float64 for float64 inputs) with autocast off; the output has query's dtype.
:func:`linear_attention_step` is the recurrent form for causal decoding, one position at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import masks as _masks
from ._checks import (
    check_arguments,
    check_qkv,
    check_same,
    check_same_dtype,
    check_tensor,
    compute_dtype,
    full_precision,
)
from ._dispatch import pick
from ._linear_forms import (
    EPS_MODES,
    FEATURE_MAPS,
    MIX,
    NORMALIZE,
    FeatureMap,
    LinearForm,
    denominator,
    elu_feature_map,
    elu_sum_feature_map,
    linear_form,
)
from ._linear_state import LinearAttentionState, Prior, check_state, final_state
from ._mixture_terms import check_mixture, log_prior

LINEAR_BACKENDS = ("chunked", "explicit")

__all__ = ["EPS_MODES", "FEATURE_MAPS", "LINEAR_BACKENDS", "MIX", "NORMALIZE", "LinearAttentionState",
           "elu_feature_map", "elu_sum_feature_map", "linear_attention", "linear_attention_step", "linear_form",
           "mlk_attention",
           "select_linear_backend"]


def _key_padding(attn_mask, B: int, H: int, L: int, S: int) -> Tensor | None:
    """Check ``attn_mask`` and return the (B?, H?, S) bool key mask (True = real key), or None."""
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    if mask is None:
        return None
    if mask.shape[-2] != 1:
        raise _masks.MaskError(
            f"linear attention supports only key-padding masks (plus is_causal): attn_mask must broadcast to "
            f"(B, 1, 1, S) or (B, H, 1, S) = {(B, H, 1, S)}, got shape {tuple(attn_mask.shape)} with a query "
            f"dimension; a mask that varies over queries cannot be expressed through the key sums")
    return mask[..., 0, :]


def _features(fm: FeatureMap, x: Tensor, name: str) -> Tensor:
    out = fm(x)
    if not isinstance(out, Tensor) or out.shape[:-1] != x.shape[:-1]:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"feature_map must map {name} of shape {tuple(x.shape)} to (..., D') keeping the leading "
                         f"dims, got {shape}")
    return out


def _key_features(form: LinearForm, key: Tensor, log_pi: Tensor | None, keep: Tensor | None) -> Tensor:
    """Key features (B, H, S, D') of key (B, H, M, S, D); padded keys give exactly zero features.

    ``mix="features"``: ``phi~(k_j) = sum_r pi_jr phi(k_jr)`` (eq. 14); ``mix="keys"``: ``phi(sum_r pi_jr k_jr)``.
    ``log_pi`` is None (uniform) or
    broadcastable to (B, H, M, S); ``keep`` is (B?, H?, S) bool or None."""
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    if keep is not None:
        key = torch.where(keep[..., None, :, None], key, zero)  # finite input to phi, zero gradient at padding
    M = key.shape[2]
    if M == 1 and log_pi is None:
        phi = _features(form.feature_map, key[:, :, 0], "key")
    else:
        pi = log_prior(log_pi, M, key.dtype, key.device).exp().unsqueeze(-1)  # (B?, H?, M, S?, 1)
        if form.mix == "keys":
            phi = _features(form.feature_map, (pi * key).sum(dim=2), "key")
        else:
            phi = (pi * _features(form.feature_map, key, "key")).sum(dim=2)
    if keep is not None:
        phi = torch.where(keep.unsqueeze(-1), phi, zero)
    return phi


def _scaled(phi: Tensor, scale: float | Tensor | None) -> Tensor:
    if isinstance(scale, Tensor):
        return phi * scale.to(phi.dtype)
    return phi if scale is None else phi * scale


def _finish(num: Tensor, den: Tensor | None, form: LinearForm, empty: Tensor | None) -> Tensor:
    """The output from the numerator (.., Dv) and the row sums (.., 1): divided under normalize="row", then
    multiplied by ``output_scale``."""
    out = num / denominator(den, form, empty) if form.normalize == "row" else num
    return out if form.output_scale == 1.0 else out * form.output_scale


def _empty_rows(keep: Tensor | None, is_causal: bool, L: int, S: int, device) -> Tensor | None:
    """(B?, H?, L?, 1) bool: query rows that may attend to no key; None when every row sees a key."""
    if is_causal:
        limit = torch.arange(L, device=device) + (S - L)  # last key index each query may see
        if keep is None:
            empty = (limit < 0).view(1, 1, L, 1)
        elif S == 0:
            empty = torch.ones(1, 1, L, 1, dtype=torch.bool, device=device)
        else:
            seen = keep.to(torch.int32).cumsum(-1)[..., limit.clamp(0, S - 1)]  # real keys among 0..limit
            empty = ((seen == 0) | (limit < 0)).unsqueeze(-1)
    else:
        if keep is None:
            return None if S > 0 else torch.ones(1, 1, L, 1, dtype=torch.bool, device=device)
        empty = ~keep.any(dim=-1)[..., None, None]
    if torch.compiler.is_compiling():  # no data-dependent branch (graph break) when compiled
        return empty
    return empty if bool(empty.any()) else None


def _to_chunks(x: Tensor, n, c: int) -> Tensor:
    """(B, H, N, D) as n chunks of c positions (B, H, n, c, D), zero past N (which contributes nothing)."""
    N = x.shape[2]
    if not isinstance(N, torch.SymInt):
        return F.pad(x, (0, 0, 0, n * c - N)).reshape(*x.shape[:2], n, c, x.shape[-1])
    # A symbolic length (torch.export, torch.compile with dynamic shapes): reshaping N into (n, c) would make the
    # trace guard on sizes (n == 1, (n c) % n) and hold for some lengths only, so the chunks are gathered by index.
    pos = torch.arange(n, device=x.device).unsqueeze(-1) * c + torch.arange(c, device=x.device)  # (n, c)
    return torch.where((pos < N).unsqueeze(-1), x[:, :, pos.clamp_max(N - 1)],
                       torch.zeros((), dtype=x.dtype, device=x.device))


def _from_chunks(x: Tensor, N) -> Tensor:
    """The first N positions of chunks (B, H, n, c, D), as (B, H, N, D)."""
    n, c = x.shape[2], x.shape[3]
    if not isinstance(N, torch.SymInt):
        return x.reshape(*x.shape[:2], n * c, x.shape[-1])[:, :, :N]
    t = torch.arange(N, device=x.device)  # by index, not a slice of a reshape (see _to_chunks)
    return x[:, :, t // c, t % c]


def _chunked_prefix(phi_q, phi_k, v, kv0, z0, chunk: int):
    """Causal sums for aligned queries/keys (query i sees keys j <= i), starting from state (kv0, z0).

    Returns numerator (B, H, N, Dv) and denominator (B, H, N)."""
    B, H, N, Dq = phi_q.shape
    Dv = v.shape[-1]
    if N == 0:
        return phi_q.new_zeros(B, H, 0, Dv), phi_q.new_zeros(B, H, 0)
    # With a symbolic length the chunk size must not depend on it, and the count of chunks is at least 2, so that
    # no size of the trace can be 1 (a size a trace specialises on).
    symbolic = isinstance(N, torch.SymInt)
    c = chunk if symbolic else min(chunk, N)
    n = N // c + 2 if symbolic else (N + c - 1) // c
    qc, kc, vc = _to_chunks(phi_q, n, c), _to_chunks(phi_k, n, c), _to_chunks(v, n, c)
    kv_chunk = kc.transpose(-1, -2) @ vc  # (B, H, n, D', Dv)
    z_chunk = kc.sum(dim=-2)  # (B, H, n, D')
    # State before chunk m: kv0 + sum of chunks < m (exclusive cumulative sum; the last sum is dropped rather than
    # the last chunk, whose n - 1 chunks left could be 1, a size a trace specialises on).
    kv_prev = torch.cat([kv0.unsqueeze(2), kv_chunk], dim=2).cumsum(dim=2)[:, :, :n]
    z_prev = torch.cat([z0.unsqueeze(2), z_chunk], dim=2).cumsum(dim=2)[:, :, :n]
    tri = _masks.causal_mask(c, c, phi_q.device)  # (bool tril is very slow on CPU)
    scores = torch.where(tri, qc @ kc.transpose(-1, -2), torch.zeros((), dtype=qc.dtype, device=qc.device))
    num = qc @ kv_prev + scores @ vc
    den = (qc @ z_prev.unsqueeze(-1)).squeeze(-1) + scores.sum(dim=-1)
    return _from_chunks(num, N), _from_chunks(den.unsqueeze(-1), N).squeeze(-1)


def _causal(phi_q, phi_k, v, chunk: int, prior: Prior | None = None):
    """Bottom-right aligned causal sums: query i sees keys j <= i + S - L, and every key of ``prior``."""
    L, S = phi_q.shape[2], phi_k.shape[2]
    off = S - L
    if off < 0:  # the first -off queries see no new key (only the prior's)
        num, den = _causal(phi_q[:, :, -off:], phi_k, v, chunk, prior)
        if prior is None:
            return F.pad(num, (0, 0, -off, 0)), F.pad(den, (-off, 0))
        head = phi_q[:, :, :-off]
        return (torch.cat([head @ prior.kv, num], dim=2),
                torch.cat([(head @ prior.k_sum.unsqueeze(-1)).squeeze(-1), den], dim=2))
    # Keys before the aligned block are seen by every query: they form the initial state.
    kv0 = phi_k[:, :, :off].transpose(-1, -2) @ v[:, :, :off]
    z0 = phi_k[:, :, :off].sum(dim=-2)
    if prior is not None:
        kv0, z0 = kv0 + prior.kv, z0 + prior.k_sum
    return _chunked_prefix(phi_q, phi_k[:, :, off:], v[:, :, off:], kv0, z0, chunk)


def _full(phi_q, phi_k, v, prior: Prior | None):
    """Non-causal sums: every query sees every key (and the prior's)."""
    kv, z = phi_k.transpose(-1, -2) @ v, phi_k.sum(dim=-2)
    if prior is not None:
        kv, z = kv + prior.kv, z + prior.k_sum
    return phi_q @ kv, (phi_q @ z.unsqueeze(-1)).squeeze(-1)


def select_linear_backend(return_weights: bool = False) -> str:
    """The implementation linear and MLK attention run when ``backend`` is None: "explicit" when the weights are
    asked for (only it builds them), "chunked" otherwise. Raises ValueError unless ``return_weights`` is a bool."""
    check_arguments(return_weights=return_weights)
    return "explicit" if return_weights else "chunked"


def _backend(backend: str | None, return_weights: bool, is_causal: bool, initial_state=None,
             output_final_state: bool = False) -> str:
    """The implementation of one call, by :func:`mgk.functional._dispatch.pick` over :data:`LINEAR_BACKENDS`."""
    check_arguments(backend=backend, backends=LINEAR_BACKENDS, return_weights=return_weights, is_causal=is_causal,
                    output_final_state=output_final_state)
    if return_weights and initial_state is not None:
        raise ValueError("return_weights=True cannot be combined with initial_state: the state keeps sums, not the "
                         "keys whose weights would be returned")

    def why_not(name: str, automatic: bool) -> str | None:
        """Why backend ``name`` cannot serve this call (None when it can), for :func:`pick`."""
        if name == "chunked" and return_weights:
            return "return_weights=True needs the (B, H, L, S) weights, which only backend='explicit' builds"
        if name == "explicit" and not return_weights and (initial_state is not None or output_final_state):
            return ("it builds the (B, H, L, S) weights and keeps no state (initial_state / output_final_state need "
                    "backend='chunked')")
        return None

    return pick(backend, LINEAR_BACKENDS, why_not)


def _length_scales(form: LinearForm, L: int, S: int, counts: Tensor | None):
    """(query, key) feature scales under normalize="length": L^(-1/4), S^(-1/4) of the tensor lengths; when decoding
    (``counts`` (B, H): real keys per row so far, this call's included), n^(-1/2) on the queries and none on the
    keys, so that the state holds unscaled sums and each call equals one call over the row's whole sequence."""
    if form.normalize != "length":
        return None, None
    if counts is None:
        return form.length_scale(L), form.length_scale(S)
    return counts.clamp_min(1).to(torch.float64).pow(-0.5).view(*counts.shape, 1, 1), None


def _decoded_lengths(form: LinearForm, prior: Prior | None, keep, B: int, H: int, S: int) -> Tensor | None:
    """(B, H) real keys per row after this call (the prior's and this call's), for normalize="length" (else
    None)."""
    if form.normalize != "length":
        return None
    if prior is not None and prior.length is None:
        raise ValueError("normalize='length' with initial_state needs initial_state.length (the real keys each row "
                         "has seen), which the states these functions return carry")
    added = (torch.full((B, H), S, dtype=torch.int64, device=prior.kv.device if prior is not None else None)
             if keep is None else keep.sum(dim=-1).to(torch.int64).expand(B, H))
    return added if prior is None else added + prior.length.to(added.device)


def _sums(phi_q, phi_k, v, is_causal: bool, chunk_size: int, prior: Prior | None):
    """(numerator (B, H, L, Dv), denominator (B, H, L)) of the chunked backend."""
    if is_causal:
        return _causal(phi_q, phi_k, v, chunk_size, prior)
    return _full(phi_q, phi_k, v, prior)


def _explicit(phi_q, phi_k, v, is_causal: bool, form: LinearForm, empty):
    """(out, weights) of the explicit backend: the (B, H, L, S) weights with ``out = weights @ v``."""
    L, S = phi_q.shape[2], phi_k.shape[2]
    weights = phi_q @ phi_k.transpose(-1, -2)  # padded keys and empty rows are already 0
    if is_causal:
        weights = torch.where(_masks.causal_mask(L, S, phi_q.device), weights,
                              torch.zeros((), dtype=weights.dtype, device=weights.device))
    weights = _finish(weights, weights.sum(dim=-1, keepdim=True), form, empty)
    return weights @ v, weights


def _run(query, key, value, log_pi, keep, is_causal, form: LinearForm, chunk_size, return_weights, backend,
         state=None, final: bool = False, scales=None):
    """Shared core of linear and MLK attention; key is (B, H, M, S, D), already checked. ``state``: the initial
    state or None; ``final``: also return the final state; ``scales``: (query, key) feature scales that replace
    normalize="length"'s (the step's explicit lengths)."""
    out_dtype = query.dtype
    B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[3]
    dt = compute_dtype(query, key, value)
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    zero = torch.zeros((), dtype=dt, device=query.device)
    with full_precision(query.device):
        phi_k = _key_features(form, k, log_pi, keep)
        prior = None if state is None else check_state(state, B, H, phi_k.shape[-1], v.shape[-1], dt)
        empty = _empty_rows(keep, is_causal, L, S, query.device)
        if empty is not None and prior is not None:  # a row that sees no new key still sees the prior's keys
            empty = empty & ~prior.seen
        if empty is not None:  # rows that see no key: inert (NaN queries there must not reach any gradient); they
            q = torch.where(empty, zero, q)  # meet only zero key features, so their num and den are exactly 0
        counts = _decoded_lengths(form, prior, keep, B, H, S) if (state is not None or final) else None
        q_scale, k_scale = scales if scales is not None else _length_scales(form, L, S, counts)
        phi_q = _scaled(_features(form.feature_map, q, "query"), q_scale)
        phi_k = _scaled(phi_k, k_scale)
        check_same("feature_map(query)", phi_q.shape[-1], "feature_map(key)", phi_k.shape[-1], "feature size D'")
        if keep is not None:
            v = torch.where(keep.unsqueeze(-1), v, zero)
        new_state = final_state(prior, phi_k, v, keep) if final else None
        if backend == "explicit":
            out, weights = _explicit(phi_q, phi_k, v, is_causal, form, empty)
        else:
            if new_state is not None and L == 1:
                # a decoding step: its one query sees every key (causal or not), so its sums are the new state's
                num, den = phi_q @ new_state.kv, (phi_q @ new_state.k_sum.unsqueeze(-1)).squeeze(-1)
            else:
                num, den = _sums(phi_q, phi_k, v, is_causal, chunk_size, prior)
            out = _finish(num, den.unsqueeze(-1), form, empty)
    out = out.to(out_dtype)
    if return_weights:
        return out, weights.to(out_dtype)
    return (out, new_state) if final else out


_STATE_DOC = """
        initial_state: a :class:`LinearAttentionState` whose keys every query also sees (they precede this call's
            keys: decoding continues a sequence), or None. Not with ``return_weights`` or backend "explicit".
        output_final_state: also return the state after this call's keys (prior's plus every real key here), to
            pass as the next call's ``initial_state`` (flash-linear-attention's convention). With either of these two,
            normalize="length" scales by each row's count of real keys so far (the state's plus this call's) instead
            of the tensor lengths, for queries and keys alike: every call then equals the last rows of one call over
            that row's whole unpadded sequence, so a prefill followed by steps gives what recomputing gives."""


def linear_attention(query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Tensor | None = None,
                     is_causal: bool = False, eps: float = 1e-6, feature_map: FeatureMap | str | None = None,
                     normalize: str = "row", output_scale: float = 1.0, eps_mode: str = "guard",
                     chunk_size: int = 64, return_weights: bool = False, backend: str | None = None,
                     initial_state: LinearAttentionState | None = None, output_final_state: bool = False):
    """Linear attention ``o_i = phi(q_i)^T sum_j phi(k_j) v_j^T / phi(q_i)^T sum_j phi(k_j)``.

    Katharopoulos et al. (2020), "Transformers are RNNs", eq. 6; the paper's linear baseline. ``normalize``,
    ``feature_map``, ``output_scale`` and ``eps_mode`` select other forms (see below and
    :mod:`mgk.functional._linear_forms`).

    Args:
        query: (B, H, L, D) floating.
        key: (B, H, S, D).
        value: (B, H, S, Dv).
        attn_mask: bool key-padding mask broadcastable to (B, 1, 1, S) or (B, H, 1, S), True = real key. Masks
            with a query dimension (L > 1) are rejected: use ``is_causal`` for causality.
        is_causal: causal, aligned bottom-right (query i sees keys j <= i + S - L).
        normalize: "row" (the default: divide by ``phi(q_i) . sum_j phi~(k_j)``), "length" (no
            denominator; query features times L^(-1/4) and key features times S^(-1/4), L and S the tensor lengths
            *including padding*, so the output depends on how far a batch is padded: the authors' LRA form) or
            "none" (no denominator, no scale).
        feature_map: "elu" or None (``elu(x) + 1``, the default), "elu_sum" (elu+1 divided by its sum over the
            head dimension: the authors' LM form) or a callable (..., D) -> (..., D'), applied to queries and keys.
            It should be non-negative so that normalised weights form a distribution.
        output_scale: finite float > 0 multiplying the output (the authors' LM uses 1/sqrt(D)); default 1.
        eps: with normalize="row", the denominator's eps, used as ``eps_mode`` says.
        eps_mode: "guard" (the default: ``eps`` replaces only a denominator that is exactly zero, so every other row
            is normalised exactly) or "add" (``den + eps`` on every row, Katharopoulos et al. 2020 and the authors'
            LM with eps = 1e-5).
        chunk_size: positions per chunk of the causal prefix sums (speed and memory only).
        return_weights: also return the explicit (B, H, L, S) weights W with ``output = W @ value`` (normalised
            rows times ``output_scale`` under normalize="row"; O(L S) memory).
        backend: None (:func:`select_linear_backend`), "chunked" or "explicit".{state}
    Returns:
        (B, H, L, Dv) in query's dtype, and the weights when ``return_weights``, or ``(out, final_state)`` with
        ``output_final_state``. Rows that may attend to no key (every key padded, or before the first visible key in
        causal mode, with no key in ``initial_state``) are exactly zero.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, mixed dtypes, options, backend or state; MaskError
        for a non-bool mask or a mask that is not a key-padding mask.
    """
    B, H, L, S, _, D = check_qkv(query, key, value, mixture=False)
    form = linear_form(eps=eps, feature_map=feature_map, normalize=normalize, output_scale=output_scale,
                       eps_mode=eps_mode, chunk_size=chunk_size)
    keep = _key_padding(attn_mask, B, H, L, S)
    name = _backend(backend, return_weights, is_causal, initial_state, output_final_state)
    return _run(query, key.unsqueeze(2), value, None, keep, is_causal, form, chunk_size, return_weights, name,
                initial_state, output_final_state)


linear_attention.__doc__ = linear_attention.__doc__.replace("{state}", _STATE_DOC)


def mlk_attention(query: Tensor, key: Tensor, value: Tensor, *, log_pi: Tensor | None = None,
                  attn_mask: Tensor | None = None, is_causal: bool = False, eps: float = 1e-6,
                  feature_map: FeatureMap | str | None = None, normalize: str = "row", output_scale: float = 1.0,
                  eps_mode: str = "guard", mix: str = "features", chunk_size: int = 64,
                  return_weights: bool = False, backend: str | None = None,
                  initial_state: LinearAttentionState | None = None, output_final_state: bool = False):
    """Attention with a mixture of linear keys (MLK, paper eq. 14).

    Linear attention whose key feature is ``phi~(k_j) = sum_r pi_jr phi(k_jr)``:
    ``o_i = phi(q_i)^T sum_j phi~(k_j) v_j^T / phi(q_i)^T sum_j phi~(k_j)``.

    Args:
        query: (B, H, L, D) floating.
        key: (B, H, M, S, D), M mixture components per key position (an :class:`mgk.MLKAttention`'s keys are
            ``module.mixture(x)``, already in this layout).
        value: (B, H, S, Dv).
        log_pi: log mixture weights broadcastable to (B, H, M, S); default uniform ``-log M``. Entries of -inf
            switch a component off. Not normalised here (un-normalised weights rescale a key's mass).
        mix: "features" (the default, eq. 14: mix the feature-mapped keys) or "keys" (``phi~(k_j) =
            phi(sum_r pi_jr k_jr)``: mix the raw keys before the feature map, the authors' LRA form; with
            position-independent weights it is one effective key projection).
        attn_mask, is_causal, eps, feature_map, normalize, output_scale, eps_mode, chunk_size, return_weights,
            backend, initial_state, output_final_state: as :func:`linear_attention`.
    Returns:
        As :func:`linear_attention`.
    Raises:
        ValueError naming the argument for wrong ranks, sizes, dtypes, options or state; MaskError for masks.
    """
    B, H, L, S, M, D, _ = check_mixture(query, key, value, log_pi, "sum", None)
    form = linear_form(eps=eps, feature_map=feature_map, normalize=normalize, output_scale=output_scale,
                       eps_mode=eps_mode, mix=mix, chunk_size=chunk_size)
    keep = _key_padding(attn_mask, B, H, L, S)
    name = _backend(backend, return_weights, is_causal, initial_state, output_final_state)
    return _run(query, key, value, log_pi, keep, is_causal, form, chunk_size, return_weights, name,
                initial_state, output_final_state)


def _step_log_pi(log_pi_t, mlk: bool, B: int, H: int, M: int) -> Tensor | None:
    if log_pi_t is None:
        return None
    if not mlk:
        raise ValueError("log_pi_t is only used with MLK keys key_t of shape (B, H, M, D); pass None")
    if not isinstance(log_pi_t, Tensor) or not log_pi_t.is_floating_point() or log_pi_t.dim() > 3 or any(
            a not in (1, b) for a, b in zip((1,) * (3 - log_pi_t.dim()) + tuple(log_pi_t.shape), (B, H, M))):
        shape = tuple(log_pi_t.shape) if isinstance(log_pi_t, Tensor) else type(log_pi_t).__name__
        raise ValueError(f"log_pi_t must be a floating tensor broadcastable to (B, H, M) = {(B, H, M)}, got {shape}")
    return log_pi_t.unsqueeze(-1)


def _step_keep(key_mask_t, B: int, H: int) -> Tensor | None:
    if key_mask_t is None:
        return None
    if not isinstance(key_mask_t, Tensor) or key_mask_t.dtype != torch.bool or key_mask_t.dim() > 2 or any(
            a not in (1, b) for a, b in zip((1,) * (2 - key_mask_t.dim()) + tuple(key_mask_t.shape), (B, H))):
        what = (f"{key_mask_t.dtype} {tuple(key_mask_t.shape)}" if isinstance(key_mask_t, Tensor)
                else type(key_mask_t).__name__)
        raise _masks.MaskError(f"key_mask_t must be a bool tensor broadcastable to (B, H) = {(B, H)} "
                               f"(True = real key), got {what}")
    return key_mask_t.reshape((1,) * (2 - key_mask_t.dim()) + tuple(key_mask_t.shape)).unsqueeze(-1)


def _step_lengths(form: LinearForm, lengths) -> tuple[float | None, float | None]:
    """(query, key) feature scales of a step: L^(-1/4), S^(-1/4) from ``lengths`` under normalize="length"."""
    if form.normalize != "length":
        return None, None
    ok = isinstance(lengths, tuple) and len(lengths) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
    if not ok:
        raise ValueError(f"normalize='length' in a step needs lengths=(L, S), the full query and key tensor lengths "
                         f"whose fourth roots scale the features, got {lengths!r}")
    return form.length_scale(lengths[0]), form.length_scale(lengths[1])


def linear_attention_step(query_t: Tensor, key_t: Tensor, value_t: Tensor, state: LinearAttentionState | None = None,
                          *, log_pi_t: Tensor | None = None, key_mask_t: Tensor | None = None,
                          feature_map: FeatureMap | str | None = None, eps: float = 1e-6, normalize: str = "row",
                          output_scale: float = 1.0, eps_mode: str = "guard", mix: str = "features",
                          lengths: tuple[int, int] | None = None):
    """One step of causal linear attention (key_t (B, H, D)) or MLK (key_t (B, H, M, D)), the recurrent form.

    Adds position t to the running sums, then attends from ``query_t`` (the diagonal is included). Running it over
    t = 0..L-1 gives the outputs of :func:`linear_attention` / :func:`mlk_attention` with ``is_causal=True`` and
    the same options. It is ``linear_attention`` / ``mlk_attention`` with ``initial_state=state`` and
    ``output_final_state=True`` on one position; a model's layers decode through their caches instead
    (``past_key_values``, :mod:`mgk.attention.cache`), which also hold the keys' layout.

    Args:
        query_t: (B, H, D); key_t: (B, H, D) or (B, H, M, D) (an :class:`mgk.MLKAttention`'s keys are
            ``module.mixture(x)``, (B, H, M, S, D); take position t as ``[:, :, :, t]``); value_t: (B, H, Dv).
        state: the state returned by the previous step; None at t = 0.
        log_pi_t: MLK log mixture weights of this key, broadcastable to (B, H, M); default uniform. Only with a
            4-dim key_t.
        key_mask_t: bool broadcastable to (B, H); False marks a padding step (its key and value are not added,
            e.g. left padding in batched decoding). None: every step is real.
        feature_map, eps, normalize, output_scale, eps_mode: as :func:`linear_attention`; mix: as
            :func:`mlk_attention`.
        lengths: (L, S), the whole query and key tensor lengths; required by normalize="length" only (the features
            are then scaled by L^(-1/4) and S^(-1/4) before the sums, reproducing one call over those lengths).
    Returns:
        ``(out_t, state)``: out_t (B, H, Dv) in query_t's dtype (zero while no real key has been seen) and the new
        :class:`LinearAttentionState` (the old one is not modified).
    Raises:
        ValueError naming the argument for wrong ranks, sizes, dtypes or options; MaskError for key_mask_t.
    """
    check_tensor(query_t, "query_t", 3, "(B, H, D)")
    mlk = isinstance(key_t, Tensor) and key_t.dim() == 4
    check_tensor(key_t, "key_t", 4 if mlk else 3, "(B, H, D) or (B, H, M, D)")
    check_tensor(value_t, "value_t", 3, "(B, H, Dv)")
    check_same_dtype(query_t=query_t, key_t=key_t, value_t=value_t)
    B, H, D = query_t.shape
    key = key_t.unsqueeze(-2) if mlk else key_t.unsqueeze(2).unsqueeze(3)  # (B, H, M, 1, D)
    check_same("query_t", B, "key_t", key_t.shape[0], "batch size")
    check_same("query_t", H, "key_t", key_t.shape[1], "number of heads")
    check_same("query_t", D, "key_t", key_t.shape[-1], "head_dim")
    check_same("key_t", B, "value_t", value_t.shape[0], "batch size")
    check_same("key_t", H, "value_t", value_t.shape[1], "number of heads")
    form = linear_form(eps=eps, feature_map=feature_map, normalize=normalize, output_scale=output_scale,
                       eps_mode=eps_mode, mix=mix)
    scales = _step_lengths(form, lengths) if form.normalize == "length" else None
    log_pi = _step_log_pi(log_pi_t, mlk, B, H, key.shape[2])
    keep = _step_keep(key_mask_t, B, H)
    if state is not None and not isinstance(state, LinearAttentionState):
        raise ValueError(f"state must be a LinearAttentionState or None, got {type(state).__name__}")
    # The recurrent form is the chunked causal form with one query and one key after the state's keys.
    out, new_state = _run(query_t.unsqueeze(2), key, value_t.unsqueeze(2), log_pi, keep, True, form, 1, False,
                          "chunked", state, True, scales)
    return out[:, :, 0], new_state
