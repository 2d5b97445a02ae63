"""The option ``key_scale`` c of the MGK family (mgk, smgk, gmgk): queries divided and keys multiplied by c before the
Gaussian score (shifts in the unscaled key space), centred on 0. Against a float64 reference written from the
formula ``A_ij = softmax_j logsumexp_r(log pi_r - |q_i / c - c k_jr|^2 / (2 sigma^2))`` on every backend and pi
mode, uncached and through a decoding cache (prefill and steps, with padding); the dot product of a conversion
kept (c -> 0 is dot-product attention with the same queries and keys); the variances it needs refused in one line;
and the shifts' gradient, which shrinks with c instead of growing as 1/c."""
import math

import pytest
import torch

import mgk
from mgk.attention import build_attention

E, H, D, L = 16, 4, 8, 7
C = 2.0 ** -12  # what a conversion uses: a power of two, so that q / c and c k are exact

KINDS = [("mgk", {}), ("smgk", {}), ("gmgk", {"num_kv_heads": 2}), ("gmgk", {"num_kv_heads": 1, "keys": "shifted"}),
         ("mgk", {"pi": "hard_e"}), ("smgk", {"pi": "soft_e", "max_len": 16})]


def _module(kind, options, c=C, seed=0):
    torch.manual_seed(seed)
    m = build_attention(kind, E, H, head_dim=D, key_scale=c, **options)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("pi_logits", "key_shift")):
                p.normal_(0.0, 0.5)
        if m.pi_mode == "soft_e":
            m.pi.copy_(torch.softmax(torch.randn_like(m.pi), dim=1))
    return m.eval()


def _reference(m, x, c, is_causal=True, key_padding_mask=None):
    """The module's self-attention in float64 from its weights and the formula, distances taken as they are."""
    w = {n: t.detach().double() for n, t in m.named_parameters()}
    x = x.double()
    B, S = x.shape[:2]
    G, M = m.kv_heads, m.num_keys
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).view(B, S, H, D).transpose(1, 2)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).view(B, S, G, D).transpose(1, 2)
    k = x @ w["mixture.k_proj.weight"].T + w["mixture.k_proj.bias"]
    if m.keys == "separate":
        k = k.view(B, S, M, G, D).permute(0, 3, 2, 1, 4)
    else:
        mu = torch.cat([torch.zeros(1, G, D, dtype=k.dtype), w["mixture.key_shift"]])
        k = k.view(B, S, G, D).transpose(1, 2)[:, :, None] - mu.transpose(0, 1)[None, :, :, None]
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, M, S, D)
    d2 = ((q[:, :, None, :, None, :] / c - c * k[:, :, :, None, :, :]) ** 2).sum(-1)  # (B, H, M, L, S)
    s = -d2 / (2.0 * math.sqrt(D))
    if m.pi_mode == "hard_e":
        score = s.max(dim=2).values
    else:
        # per-position weights at each row's key positions, counted from its first real key
        pos = torch.arange(S).expand(B, S) if key_padding_mask is None else \
            ((~key_padding_mask).cumsum(dim=1) - 1).clamp_min(0)
        log_pi = torch.log_softmax(w["mixture.pi_logits"], dim=1) if m.pi_mode == "learned" else \
            m.pi.detach().double().log()
        log_pi = log_pi.repeat_interleave(H // G, dim=0)
        log_pi = log_pi[None, :, :, None, None] if log_pi.dim() == 2 else \
            log_pi[:, :, pos].permute(2, 0, 1, 3)[:, :, :, None, :]
        score = torch.logsumexp(s + log_pi, dim=2)
    allowed = torch.ones(B, S, S, dtype=torch.bool)
    if is_causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, :]
    score = score.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(score, dim=-1) @ v
    out = out.transpose(1, 2).reshape(B, S, H * D)
    return out @ w["out_proj.weight"].T + w["out_proj.bias"]


@pytest.mark.parametrize("kind,options", KINDS, ids=[f"{k}{o}" for k, o in KINDS])
def test_scaled_attention_equals_the_float64_formula_on_every_backend(kind, options, backend):
    if backend == "sdpa" and options.get("pi") == "hard_e":
        pytest.skip("Hard-E's max over components has no dot-product (SDPA) form")
    m = _module(kind, options)
    m.backend = backend
    x = torch.randn(2, L, E)
    ref = _reference(m, x, C)
    got = m(x, x, x, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,options", KINDS, ids=[f"{k}{o}" for k, o in KINDS])
def test_a_cache_at_key_scale_equals_the_uncached_call(kind, options):
    """Prefill of 4 tokens (one row left-padded), then steps: the same outputs as one uncached call. The centre is
    0 from the first call on (a query-chosen one would carry 1/c-sized queries into every key)."""
    m = _module(kind, options)
    x = torch.randn(2, L, E)
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, :2] = True
    with torch.no_grad():
        full = m(x, x, x, is_causal=True, key_padding_mask=pad, need_weights=False)[0]
        cache = m.new_cache()
        outs = [m(x[:, :4], is_causal=True, key_padding_mask=pad[:, :4], need_weights=False,
                  past_key_values=cache)[0]]
        for t in range(4, L):
            outs.append(m(x[:, t:t + 1], is_causal=True, need_weights=False, past_key_values=cache)[0])
    got = torch.cat(outs, dim=1)
    real = ~pad
    torch.testing.assert_close(got[real], full[real], atol=2e-5, rtol=1e-4)
    ref = _reference(m, x, C, key_padding_mask=pad).float()
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=1e-4)


def test_a_small_key_scale_is_dot_product_attention_with_the_same_queries_and_keys():
    """M components equal to one key, c -> 0: the score q.k / sigma^2 - c^2 |k|^2 / (2 sigma^2) is softmax
    attention's q.k / sqrt(D) up to c^2 |k|^2 / (2 sqrt(D)), here far below float32's rounding."""
    torch.manual_seed(0)
    soft = build_attention("softmax", E, H, head_dim=D).eval()
    m = build_attention("mgk", E, H, head_dim=D, key_scale=C).eval()
    with torch.no_grad():
        for name in ("q_proj", "v_proj", "out_proj"):
            getattr(m, name).load_state_dict(getattr(soft, name).state_dict())
        m.mixture.k_proj.weight.copy_(soft.k_proj.weight.repeat(2, 1) * 8.0)  # keys 8x: |k|^2 terms matter at c=1
        m.mixture.k_proj.bias.copy_(soft.k_proj.bias.repeat(2) * 8.0)
        soft.k_proj.weight.mul_(8.0)
        soft.k_proj.bias.mul_(8.0)
    x = torch.randn(2, L, E) * 3.0
    want = soft(x, x, x, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(m(x, x, x, is_causal=True, need_weights=False)[0], want, atol=1e-5, rtol=1e-5)
    m1 = build_attention("mgk", E, H, head_dim=D).eval()
    m1.load_state_dict(m.state_dict())
    assert (m1(x, x, x, is_causal=True, need_weights=False)[0] - want).abs().max() > 1e-2  # the key-norm term


@pytest.mark.parametrize("sigma2", ["learned", (2.0, 1.0)])
def test_key_scale_refuses_variances_that_keep_the_query_norm_term(sigma2):
    with pytest.raises(ValueError, match=r"key_scale=.*sigma2"):
        build_attention("mgk", E, H, head_dim=D, key_scale=0.5, sigma2=sigma2)
    build_attention("mgk", E, H, head_dim=D, key_scale=0.5, sigma2=(2.0, 2.0))  # equal ones are taken
    build_attention("mgk", E, H, head_dim=D, sigma2=sigma2)  # and c = 1 takes any


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_key_scale_must_be_positive(value):
    with pytest.raises(ValueError, match="key_scale"):
        mgk.build_attention("mgk", E, H, key_scale=value)


def test_shift_gradients_do_not_grow_as_the_scale_shrinks():
    """Shifts live in the unscaled key space (k_r = c (k - mu_r)): a shift's term in the score, -q . mu_r / sigma^2,
    is one offset for every key of a row, which the softmax cancels, so a shift acts only through
    c^2 |k - mu_r|^2 and its gradient shrinks with c^2. Had the shifts been applied after the scale, that offset
    would be q . mu_r / (c sigma^2) and a step on them would move the scores 1/c times as far."""
    grads = []
    for c in (1.0, 2.0 ** -3, 2.0 ** -6):
        m = _module("smgk", {}, c=c)
        x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(1))
        m(x, x, x, is_causal=True, need_weights=False)[0].square().sum().backward()
        grads.append(m.mixture.key_shift.grad.abs().max().item())
    assert grads[0] > grads[1] > grads[2] > 0
    assert grads[2] / grads[1] == pytest.approx(2.0 ** -6, rel=0.5)  # ~c^2 between c = 1/8 and 1/64
