"""Grouped mixture keys (kind "gmgk"): H query heads share G groups of MGK's Gaussian mixture keys. Against a float64
reference written from the formula (query head h scores with group h // (H / G)), both key modes, masks and
causality; M = 1 against the grouped Gaussian formula (not GQA: the key-norm term differs); G = H loads MGK / sMGK
checkpoints and gives their outputs; the decoding cache stores G groups and equals the uncached forward; labels,
FLOPs and the cache's size from the registry."""
import copy
import math

import pytest
import torch

from mgk.attention import build_attention, get_kind
from mgk.attention.registry import display_label, make_options, run_label

E, D = 16, 4


def _randomise(m, seed=0):
    """Mixture weights, learned variances and shifts made non-uniform so that each matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("pi_logits", "log_sigma2", "key_shift")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
        if m.pi_mode == "soft_e":
            m.pi.copy_(torch.softmax(torch.randn(m.pi.shape, generator=g, dtype=m.pi.dtype), dim=1))
    return m


def _keys(m, w, x):
    """The groups' component keys (B, G, M, S, D) from the weights ``w`` (float64) as the formula defines them:
    M projections per group (component-major rows), or one projection minus the shifts (mu_1 = 0)."""
    B, S = x.shape[:2]
    G, M = m.num_kv_heads, m.num_keys
    k = x @ w["mixture.k_proj.weight"].T + w["mixture.k_proj.bias"]
    if m.keys == "separate":
        return k.view(B, S, M, G, D).permute(0, 3, 2, 1, 4)
    mu = torch.cat([torch.zeros(1, G, D, dtype=k.dtype), w["mixture.key_shift"]])  # (M, G, D)
    return k.view(B, S, G, D).transpose(1, 2)[:, :, None] - mu.transpose(0, 1)[None, :, :, None]


def _reference(m, x, key_padding_mask=None, is_causal=False):
    """The module's self-attention in float64 from its weights: for query head h of group g = h // (H / G),
    score_ij = logsumexp_r(log pi_gr - |q_i - k_gjr|^2 / (2 sigma_gr^2)) (max over r for Hard-E), softmax over the
    allowed keys (padding True = not allowed; causal bottom-right), values of group g, output projection."""
    H, G, M = m.num_heads, m.num_kv_heads, m.num_keys
    w = {n: p.detach().double() for n, p in m.named_parameters()}
    x = x.double()
    B, L = x.shape[:2]
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).view(B, L, H, D).transpose(1, 2)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).view(B, L, G, D).transpose(1, 2)
    k = _keys(m, w, x)
    # log pi (B, G, S, M) at each row's key positions (counted from its first real key), or None for Hard-E
    pos = torch.arange(L).expand(B, L) if key_padding_mask is None else \
        ((~key_padding_mask).cumsum(dim=1) - 1).clamp_min(0)
    table = None if m.pi_mode == "hard_e" else torch.log_softmax(w["mixture.pi_logits"], dim=1) \
        if m.pi_mode == "learned" else m.pi.detach().double().log()  # (G, M) or (G, M, max_len)
    log_pi = None if table is None else table[None, :, None, :] if table.dim() == 2 else \
        table[:, :, pos].permute(2, 0, 3, 1)
    s2 = m.group_variances.detach().double().expand(G, M)
    allowed = torch.ones(B, L, L, dtype=torch.bool)
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, :]
    if is_causal:
        allowed &= torch.tril(torch.ones(L, L, dtype=torch.bool))
    heads = []
    for h in range(H):
        g = h // (H // G)
        d2 = ((q[:, h, :, None, None, :] - k[:, g].transpose(1, 2)[:, None]) ** 2).sum(-1)  # (B, L, S, M)
        terms = -d2 / (2 * s2[g])
        score = terms.amax(-1) if log_pi is None else torch.logsumexp(terms + log_pi[:, g, None], dim=-1)
        weights = torch.softmax(score.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        heads.append(weights @ v[:, g])
    out = torch.stack(heads, dim=1).transpose(1, 2).reshape(B, L, H * D)
    return out @ w["out_proj.weight"].T + w["out_proj.bias"]


def _padded(B, L):
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, :2] = True  # left padding
    pad[0, -1] = True  # and a padded last key
    return pad


@pytest.mark.parametrize("keys", ["separate", "shifted"])
@pytest.mark.parametrize("sigma2", [(3.0, 0.7), "learned"], ids=["unequal", "learned"])
def test_outputs_equal_the_float64_formula(keys, sigma2):
    torch.manual_seed(0)
    m = _randomise(build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=2, keys=keys, sigma2=sigma2,
                                   dtype=torch.float64))
    x = torch.randn(2, 7, E, dtype=torch.float64)
    pad = _padded(2, 7)
    for kwargs in ({}, {"key_padding_mask": pad, "is_causal": True}):
        got = m(x, need_weights=False, **kwargs)[0]
        torch.testing.assert_close(got, _reference(m, x, **kwargs), atol=1e-9, rtol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("H,G", [(2, 1), (3, 1), (6, 3), (8, 2)])
@pytest.mark.parametrize("pi", ["learned", "soft_e", "hard_e"])
@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_outputs_equal_the_float64_formula_at_every_ratio_and_pi_mode(H, G, pi, keys):
    torch.manual_seed(H + G)
    m = _randomise(build_attention("gmgk", E, H, head_dim=D, num_kv_heads=G, keys=keys, pi=pi, num_keys=3,
                                   max_len=16, dtype=torch.float64))
    x = torch.randn(2, 6, E, dtype=torch.float64)
    kwargs = {"key_padding_mask": _padded(2, 6), "is_causal": True}
    torch.testing.assert_close(m(x, need_weights=False, **kwargs)[0], _reference(m, x, **kwargs), atol=1e-9,
                               rtol=1e-9)


def test_one_component_is_the_grouped_gaussian_score_not_gqa():
    """M = 1: softmax_j((q_i . k_gj - |k_gj|^2 / 2) / sigma^2) with sigma^2 = sqrt(D), the key-norm term that GQA
    lacks; GQA with the same weights differs as soon as the keys' norms differ."""
    torch.manual_seed(1)
    H, G = 4, 2
    m = build_attention("gmgk", E, H, head_dim=D, num_kv_heads=G, num_keys=1, dtype=torch.float64)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    w = {n: p.detach() for n, p in m.named_parameters()}
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).view(2, 6, H, D).transpose(1, 2)
    k = (x @ w["mixture.k_proj.weight"].T + w["mixture.k_proj.bias"]).view(2, 6, G, D).transpose(1, 2)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).view(2, 6, G, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = (q @ k.transpose(-1, -2) - (k * k).sum(-1)[:, :, None] / 2) / math.sqrt(D)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    out = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1) @ v
    want = out.transpose(1, 2).reshape(2, 6, H * D) @ w["out_proj.weight"].T + w["out_proj.bias"]
    got = m(x, need_weights=False, is_causal=True)[0]
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    gqa = build_attention("gqa", E, H, head_dim=D, num_kv_heads=G, dtype=torch.float64)
    gqa.load_state_dict({n.removeprefix("mixture."): t for n, t in m.state_dict().items()
                         if n.endswith((".weight", ".bias"))})
    assert (gqa(x, need_weights=False, is_causal=True)[0] - got).abs().max() > 1e-3


PI_MODES = [{}, {"pi_shape": "position"}, {"pi_shape": "layer"}, {"pi": "soft_e"}, {"pi": "hard_e"},
            {"sigma2": "learned"}, {"pi_norm": "none"}]


@pytest.mark.parametrize("kind", ["mgk", "smgk"])
@pytest.mark.parametrize("options", PI_MODES, ids=[",".join(f"{k}={v}" for k, v in o.items()) or "default"
                                                  for o in PI_MODES])
def test_as_many_groups_as_heads_is_mgk_whose_checkpoint_loads(kind, options):
    torch.manual_seed(2)
    options = {**options, "max_len": 16}
    source = _randomise(build_attention(kind, E, 4, head_dim=D, **options)).eval()
    m = build_attention("gmgk", E, 4, head_dim=D, keys="shifted" if kind == "smgk" else "separate",
                        **options).eval()
    m.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(2, 7, E)
    pad = _padded(2, 7)
    for kwargs in ({}, {"key_padding_mask": pad, "is_causal": True}):
        torch.testing.assert_close(m(x, need_weights=False, **kwargs)[0],
                                   source(x, need_weights=False, **kwargs)[0], atol=1e-6, rtol=1e-6)


def test_groups_must_divide_the_heads_naming_num_kv_heads():
    with pytest.raises(ValueError, match=r"^num_kv_heads=3 must divide num_heads=4 [^\n]*$"):
        build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=0)


def test_parameters_and_soft_e_weights_belong_to_the_key_groups():
    m = build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=2, keys="shifted", num_keys=3, pi="soft_e",
                        max_len=8, sigma2="learned")
    shapes = {n: tuple(t.shape) for n, t in m.state_dict().items()}
    assert shapes["mixture.k_proj.weight"] == (2 * D, E) and shapes["mixture.key_shift"] == (2, 2, D)
    assert shapes["mixture.pi"] == (2, 3, 8) and shapes["log_sigma2"] == (2, 3) and shapes["v_proj.weight"] == (8, E)
    # one training step: the E-step's statistics of a group are those of its two heads, summed
    m.train()
    m(torch.randn(2, 5, E), need_weights=False, is_causal=True)[0].sum().backward()
    assert m._accumulator().shape == (2, 4, 8) and m.soft_e_step() == 1
    torch.testing.assert_close(m.pi[:, :, :5].sum(dim=1), torch.ones(2, 5))


def test_labels_flops_and_the_registrys_cache_bytes():
    spec = get_kind("gmgk")
    assert display_label("gmgk", 8, make_options("gmgk", num_kv_heads=2)) == "gMGK x 8 (kv 2)"
    assert display_label("gmgk", 8, make_options("gmgk", num_kv_heads=2, keys="shifted")) == \
        "gMGK x 8 (kv 2, shifted)"
    assert display_label("gmgk", 8, make_options("gmgk")) == "gMGK x 8"
    assert run_label("gmgk", 8, make_options("gmgk", num_kv_heads=2, keys="shifted")) == "gmgk-8 kv2 shifted"
    per_token = dict(num_heads=8, head_dim=16, length=1)
    assert spec.cache.cache_bytes(make_options("gmgk", num_kv_heads=2, keys="shifted"), **per_token) == 272
    assert spec.cache.cache_bytes(make_options("gmgk", num_kv_heads=1), **per_token) == 200
    shape = dict(heads=8, length=64, batch=1, embed_dim=128, head_dim=16, causal=True, backward=False)
    for keys, other in (("separate", "mgk"), ("shifted", "smgk")):  # G = H costs what MGK / sMGK cost
        assert spec.flops(make_options("gmgk", keys=keys), **shape) == get_kind(other).flops(make_options(other),
                                                                                              **shape)
    # G = 2 of 8: the value and M = 2 key projections of width 2 D instead of 8 D
    saved = spec.flops(make_options("gmgk"), **shape) - spec.flops(make_options("gmgk", num_kv_heads=2), **shape)
    assert saved == 2 * 64 * 128 * 16 * (8 - 2) * 3


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_measured_cache_bytes_are_the_formula_and_hold_groups_not_heads(keys):
    m = build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=2, keys=keys, num_keys=3).eval()
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randn(3, 11, E), past_key_values=cache, is_causal=True, need_weights=False)
    spec = get_kind("gmgk")
    assert cache.nbytes() == 3 * spec.cache.cache_bytes(make_options("gmgk", num_kv_heads=2, keys=keys, num_keys=3),
                                                        num_heads=4, head_dim=D, length=11)
    assert cache._buffers["keys"].shape[:2] == (3, 2) and cache._buffers["values"].shape[:2] == (3, 2)


def _decode(m, x, pad, chunks):
    """Outputs of a left-padded prefill and then the given chunks of new tokens, with one cache."""
    cache, outs, t = m.new_cache(), [], 0
    with torch.no_grad():
        for n in chunks:
            mask = pad[:, t:t + n] if t == 0 else None
            outs.append(m(x[:, t:t + n], past_key_values=cache, is_causal=True, need_weights=False,
                          key_padding_mask=mask)[0])
            t += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("G,pi", [(1, "learned"), (2, "learned"), (1, "soft_e")])
@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_cached_decoding_equals_the_uncached_forward(keys, G, pi):
    torch.manual_seed(3)
    m = _randomise(build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=G, keys=keys, sigma2=(2.0, 1.0),
                                   pi=pi, max_len=16)).eval()
    x = torch.randn(3, 12, E)
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[1, :3] = True
    pad[2, :1] = True
    got = _decode(m, x, pad, (5, 1, 1, 3, 1, 1))
    with torch.no_grad():
        want = m(x, need_weights=False, is_causal=True, key_padding_mask=pad)[0]
    torch.testing.assert_close(got[~pad], want[~pad], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_compiled_forward_and_traced_decoding_step_equal_eager(keys):
    torch._dynamo.reset()
    m = _randomise(build_attention("gmgk", E, 4, head_dim=D, num_kv_heads=2, keys=keys)).eval()
    x = torch.randn(2, 9, E)
    pad = _padded(2, 9)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for kwargs in ({"is_causal": True}, {"key_padding_mask": pad}):
            torch.testing.assert_close(compiled(x, need_weights=False, **kwargs)[0],
                                       m(x, need_weights=False, **kwargs)[0], atol=1e-5, rtol=1e-5)
    # one-token steps over a cache of fixed capacity, traced once (generate(compile=True)'s step)
    step = torch.compile(lambda token, cache: m(token, past_key_values=cache, is_causal=True, need_weights=False)[0],
                         backend="aot_eager", fullgraph=True, dynamic=False)
    cache = m.new_cache()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        outs = [m(x[:, :4], past_key_values=cache, is_causal=True, need_weights=False)[0]]
        cache.fix_capacity(9)
        for t in range(4, 9):
            outs.append(step(x[:, t:t + 1], cache))
            cache.advance(1)
        want = m(x, need_weights=False, is_causal=True)[0]
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-5, rtol=1e-5)


def test_swap_from_torch_pools_each_groups_keys_and_values():
    """nn.TransformerEncoderLayer (4 heads) -> gmgk with 2 groups: queries and outputs copied, each group's value
    projection the mean of its two heads' (Ainslie et al.), pi uniform. The keys: with shifted keys the one key
    projection is pooled too; with M = 2 separate keys a group's two heads are its two components, unpooled (a
    multi-head layer is a grouped one with a group per head, M G = H of them: the groups kept as components)."""
    import mgk

    torch.manual_seed(4)
    layer = torch.nn.TransformerEncoderLayer(E, 4, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    w = layer.self_attn.in_proj_weight.detach().clone()
    shifted = mgk.swap_attention(copy.deepcopy(layer), "gmgk", num_kv_heads=2, keys="shifted").self_attn
    mgk.swap_attention(layer, "gmgk", num_kv_heads=2)
    new = layer.self_attn
    assert new.num_kv_heads == 2 and new.keys == "separate"

    def pooled(t):
        return t.reshape(2, 2, D, E).mean(dim=1).reshape(2 * D, E)

    torch.testing.assert_close(new.q_proj.weight, w[:E])
    heads = w[E:2 * E].reshape(2, 2, D, E)  # (group, head in group, D, E)
    torch.testing.assert_close(new.k_proj.weight, heads.transpose(0, 1).reshape(4 * D, E))  # component-major
    torch.testing.assert_close(new.v_proj.weight, pooled(w[2 * E:]))
    torch.testing.assert_close(shifted.k_proj.weight, pooled(w[E:2 * E]))
    torch.testing.assert_close(shifted.v_proj.weight, pooled(w[2 * E:]))
    with torch.no_grad():
        causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
        out = layer(torch.randn(2, 5, E), src_mask=causal, is_causal=True)
    assert out.shape == (2, 5, E) and out.isfinite().all()


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_swap_from_gqa_keeps_its_grouped_keys_and_values_exactly(keys):
    """A GQA layer's key/value heads are copies per group, so the mean of each group is the GQA head itself: the
    converted components' mean key (the one key of shifted keys) and the values equal the source's."""
    import mgk

    torch.manual_seed(5)
    source = build_attention("gqa", E, 4, head_dim=D, num_kv_heads=2).eval()
    new = mgk.swap_attention(source, "gmgk", num_kv_heads=2, keys=keys)
    assert new.conversion["rule"] == "same"
    parts = 2 if keys == "separate" else 1
    torch.testing.assert_close(new.k_proj.weight.view(parts, 2 * D, E).mean(dim=0), source.k_proj.weight)
    torch.testing.assert_close(new.k_proj.bias.view(parts, 2 * D).mean(dim=0), source.k_proj.bias)
    for name in ("q_proj", "v_proj", "out_proj"):
        torch.testing.assert_close(getattr(new, name).weight, getattr(source, name).weight)
    torch.testing.assert_close(torch.softmax(new.pi_logits, dim=1), torch.full((2, 2), 0.5))
    # and back: gmgk reads as a multi-head layer (each group's mean key repeated), so -> gqa is exact
    back = mgk.swap_attention(new, "gqa", num_kv_heads=2)
    torch.testing.assert_close(back.k_proj.weight, source.k_proj.weight)
    torch.testing.assert_close(back.v_proj.weight, source.v_proj.weight)


def test_swap_merging_heads_into_components_pools_each_component_over_the_group():
    """8 heads -> 4 heads of 2 components (the merge rule), in 2 groups: each component's key projection is the
    mean over the group's heads of the merged one (component-major rows)."""
    import mgk
    from mgk.convert.regroup import merge_heads

    torch.manual_seed(6)
    layer = torch.nn.TransformerEncoderLayer(2 * E, 8, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    attn = layer.self_attn
    w, b = attn.in_proj_weight.detach().clone(), attn.in_proj_bias.detach().clone()
    mgk.swap_attention(layer, "gmgk", num_heads=4, num_kv_heads=2)
    new = layer.self_attn
    assert new.conversion["rule"] == "merge"
    source = {f"{p}.{n}": t[i * 2 * E:(i + 1) * 2 * E] for i, p in enumerate(("q_proj", "k_proj", "v_proj"))
              for n, t in (("weight", w), ("bias", b))}
    source.update({"out_proj.weight": attn.out_proj.weight.detach(), "out_proj.bias": attn.out_proj.bias.detach()})
    merged = merge_heads(source, new.conversion["groups"], D)
    want = merged["k_proj.weight"].reshape(2, 2, 2, D, 2 * E).mean(dim=2).reshape(2 * 2 * D, 2 * E)
    torch.testing.assert_close(new.k_proj.weight, want)
