"""A padded batch through ``TransformerLM.hidden`` / ``next_log_probs`` without a cache is the uncached causal forward
of each row's real tokens: the same outputs and, parameter by parameter, the same gradients as the rows alone (issue
30: the padded path went through a decoding cache, whose detached entries gave softmax's v_proj a zero gradient and
its q_proj and tied embedding gradients off by 54-71%)."""
from __future__ import annotations

import pytest
import torch

from mgk.attention.registry import get_kind, kind_variants, variant_name
from mgk.models import AttentionConfig, LMConfig, TransformerLM

LENGTHS, L, MAX_LEN = (9, 5, 2, 0), 12, 10  # a row of padding only; padded past max_len, every row within it
# Beyond the registry's variants: per-position learned weights, and normalize="length" (scaled by each row's length)
CASES = [*kind_variants(), ("mgk", {"pi_shape": "position"}), ("linear", {"normalize": "length"}),
         ("mlk", {"mix": "keys", "normalize": "length"})]


def _lm(kind, options):
    """A float64 two-layer LM in training mode (no dropout), with non-uniform mixture weights."""
    torch.manual_seed(0)
    if "max_len" in get_kind(kind).options.names():
        options = {"max_len": MAX_LEN, **options}
    cfg = LMConfig(vocab_size=30, d_model=16, num_layers=2, ffn_dim=32, dropout=0.0, cutoffs=(10,),
                   attention=AttentionConfig(kind=kind, num_heads=2, head_dim=8, options=options))
    model = TransformerLM(cfg).double().train()
    with torch.no_grad():
        for attn in (block.attn for block in model.blocks):
            mixture = getattr(attn, "mixture", None)
            if mixture is not None and mixture.pi_mode == "learned":
                mixture.pi_logits.normal_()
            if mixture is not None and mixture.pi_mode == "soft_e":
                mixture.pi.copy_(torch.softmax(torch.randn_like(mixture.pi), dim=1))
    return model


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind,options", CASES, ids=[variant_name(k, v) for k, v in CASES])
def test_a_left_padded_batch_has_the_outputs_and_gradients_of_its_rows_alone(kind, options):
    model = _lm(kind, options)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 30, (len(LENGTHS), L), generator=gen)
    pad = torch.arange(L) < torch.tensor([L - n for n in LENGTHS]).unsqueeze(1)  # left padding
    weights = torch.randn(len(LENGTHS), L, 16, generator=gen, dtype=torch.float64) * (~pad).unsqueeze(-1)
    target = torch.randint(0, 30, (len(LENGTHS),), generator=gen)

    h = model.hidden(tokens, key_padding_mask=pad)
    assert h.shape == (len(LENGTHS), L, 16) and torch.isfinite(h).all()
    log_p = model.next_log_probs(tokens, key_padding_mask=pad)
    real = [b for b, n in enumerate(LENGTHS) if n]
    got = _grads(model, (h * weights).sum() + log_p[real, target[real]].sum())

    loss = 0.0
    for b in real:
        row = tokens[b:b + 1, L - LENGTHS[b]:]
        alone = model.hidden(row)
        torch.testing.assert_close(h[b:b + 1, L - LENGTHS[b]:], alone, atol=1e-12, rtol=1e-10)
        loss = loss + (alone * weights[b:b + 1, L - LENGTHS[b]:]).sum() + model.next_log_probs(row)[0, target[b]]
    want = _grads(model, loss)
    wrong = [name for name in want if not torch.allclose(got[name], want[name], atol=1e-10, rtol=1e-8)]
    assert not wrong, f"gradients differ from the rows alone for {wrong}"
    assert all(want[name].abs().sum() > 0 for name in want if "v_proj" in name or "q_proj" in name)


def test_a_bad_padding_mask_is_one_line_naming_it():
    model = _lm("softmax", {})
    with pytest.raises(ValueError, match=r"^key_padding_mask must be bool of the tokens' shape \(2, 3\) \(True = "
                                         r"padding\), got torch.int64 \(2, 3\)$"):
        model.hidden(torch.zeros(2, 3, dtype=torch.int64), key_padding_mask=torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("kind", ["mgk", "smgk"])
def test_a_left_padded_batch_gathers_the_soft_e_statistics_of_its_rows_alone(kind):
    """Soft-E trains its weights from the E-step statistics a backward commits, per key position: a padded batch
    commits those of its rows alone, at the positions counted from each row's first real token (the cached path
    committed none)."""
    model = _lm(kind, {"pi": "soft_e"})
    tokens = torch.randint(0, 30, (len(LENGTHS), L), generator=torch.Generator().manual_seed(1))
    pad = torch.arange(L) < torch.tensor([L - n for n in LENGTHS]).unsqueeze(1)

    def committed():
        sums = [block.attn._accumulator().clone() for block in model.blocks]
        for block in model.blocks:
            block.attn._accumulator().zero_()
        return sums

    model.hidden(tokens, key_padding_mask=pad).sum().backward()
    got = committed()
    for b, n in enumerate(LENGTHS):
        if n:
            model.hidden(tokens[b:b + 1, L - n:]).sum().backward()
    want = committed()
    pairs = sum(n * (n + 1) // 2 for n in LENGTHS)  # causal (query, key) pairs, counted per head
    assert all(bool((w[:, -1].sum(dim=1) == pairs).all()) for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
