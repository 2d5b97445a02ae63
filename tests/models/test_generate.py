"""``TransformerLM.generate``: greedy decoding through the cache equals the argmax of the uncached model step by step
(every kind), sampling is reproducible with a generator, left-padded prompts continue as each row alone, eos ends
rows, the model's mode is restored, and decoding past per-position weights is refused in one line."""
from __future__ import annotations

import pytest
import torch

from mgk.attention.registry import kind_variants, variant_name
from mgk.models import AttentionConfig, LMConfig, TransformerLM
from mgk.models.sampling import next_token

V = 40


def _lm(kind="mgk", options=None, layers=2, max_len=64, seed=0):
    torch.manual_seed(seed)
    options = dict(options or {})
    attn = AttentionConfig(kind=kind, num_heads=2, head_dim=8)
    if "max_len" in type(attn.options).names():
        options.setdefault("max_len", max_len)
    cfg = LMConfig(vocab_size=V, d_model=16, num_layers=layers, ffn_dim=32, dropout=0.1, cutoffs=(10,),
                   attention=attn.with_options(**options))
    model = TransformerLM(cfg)
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block.attn, "pi_logits"):
                block.attn.pi_logits.normal_()
    return model


def _greedy_uncached(model, idx, n):
    """The reference: the whole sequence through the plain forward at every step, its last argmax appended."""
    model.eval()
    out = idx.clone()
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, model.log_probs(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


CASES = [*kind_variants(), ("mgk", {"pi_shape": "position"}), ("mlk", {"feature_map": "elu_sum"})]


@pytest.mark.parametrize("kind,options", CASES, ids=[variant_name(k, v) for k, v in CASES])
def test_greedy_generation_is_the_argmax_of_the_uncached_model_step_by_step(kind, options):
    model = _lm(kind, options)
    idx = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    got = model.generate(idx, 12, temperature=0)
    assert got.shape == (2, 19) and torch.equal(got[:, :7], idx)
    assert torch.equal(got, _greedy_uncached(model, idx, 12))
    assert torch.equal(model.generate(idx, 12, temperature=0, use_cache=False), got)


def test_sampling_is_reproducible_with_a_generator_and_the_cache_changes_nothing():
    model = _lm("smgk")
    idx = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(2))

    def sample(seed, **kw):
        return model.generate(idx, 10, temperature=1.3, top_k=20, top_p=0.9,
                              generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(5), sample(5))
    assert torch.equal(sample(5), sample(5, use_cache=False))
    assert not torch.equal(sample(5), sample(6))


@pytest.mark.parametrize("kind", ["softmax", "mgk", "smgk", "mlk"])
def test_left_padded_prompts_continue_as_each_row_alone(kind):
    """Positions (sinusoids and per-position weights) start at each row's first real token."""
    model = _lm(kind, {"pi_shape": "position"} if kind != "softmax" else {})
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, V, (3, 8), generator=g)
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[0, :5], pad[2, :2] = True, True
    got = model.generate(idx.masked_fill(pad, 0), 9, temperature=0, key_padding_mask=pad)
    for b in range(3):
        start = int(pad[b].sum())
        assert torch.equal(got[b, start:], model.generate(idx[b:b + 1, start:], 9, temperature=0)[0]), b


def test_eos_ends_rows_and_generation_stops_when_all_have_ended():
    model = _lm("softmax")
    idx = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(4))
    free = model.generate(idx, 30, temperature=0)
    eos = int(free[0, 5])  # the first row's third new token
    got = model.generate(idx, 30, temperature=0, eos=eos)
    first = int((got[0, 3:] == eos).nonzero()[0])
    assert torch.all(got[0, 3 + first:] == eos)
    ended = [(row[3:] == eos).nonzero() for row in got]
    if all(len(e) for e in ended):  # every row ended: generation stopped at the last one to end
        assert got.shape[1] == 3 + 1 + max(int(e[0]) for e in ended)


def test_mode_is_restored_and_nothing_is_recorded_for_autograd():
    model = _lm("mgk", {"pi": "soft_e"})
    model.train()
    pi = model.blocks[0].attn.pi.clone()
    out = model.generate(torch.zeros(1, 2, dtype=torch.int64), 5)
    assert model.training and not out.requires_grad and torch.equal(model.blocks[0].attn.pi, pi)
    model.eval()
    model.generate(torch.zeros(1, 2, dtype=torch.int64), 2)
    assert not model.training


def test_per_position_weights_refuse_to_generate_past_their_trained_length_in_one_line():
    model = _lm("mgk", {"pi_shape": "position"}, max_len=16)
    idx = torch.zeros(1, 10, dtype=torch.int64)
    assert model.generate(idx, 7, temperature=0).shape == (1, 17)  # reads positions 0..15
    with pytest.raises(ValueError, match=r"^pi_shape='position' has mixture weights for max_len=16 positions .*"
                                         r"a prompt of 10 tokens plus max_new_tokens=8 needs 17$"):
        model.generate(idx, 8)


def test_normalize_length_is_generated_without_the_cache_only():
    model = _lm("linear", {"normalize": "length"})
    idx = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="normalize='length'.*use_cache=False"):
        model.generate(idx, 2)
    assert torch.equal(model.generate(idx, 4, temperature=0, use_cache=False), _greedy_uncached(model, idx, 4))


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p"),
    ({"eos": V}, "eos"), ({"max_new_tokens": -1}, "max_new_tokens"), ({"generator": 3}, "generator"),
    ({"key_padding_mask": torch.tensor([[False, True]])}, "left"),
    ({"key_padding_mask": torch.tensor([[True, True]])}, "without a real prompt token"),
])
def test_bad_arguments_name_themselves(kwargs, message):
    model = _lm("softmax", layers=1)
    call = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 2, dtype=torch.int64), **call)


@pytest.mark.parametrize("prompt,pad", [([[0, V]], None), ([[-1, 0]], None), ([[V + 5, 1]], [[True, False]])])
def test_token_ids_outside_the_vocabulary_are_refused_naming_idx(prompt, pad):
    """An id outside [0, V) (a padding position's too: the embedding reads it) failed inside the embedding with
    "index out of range in self", naming nothing."""
    model = _lm("softmax", layers=1)
    mask = None if pad is None else torch.tensor(pad)
    with pytest.raises(ValueError, match=rf"^idx must hold token ids in \[0, {V}\)"):
        model.generate(torch.tensor(prompt), 2, key_padding_mask=mask)


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    log_probs = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]), dim=-1).expand(4000, 5)
    g = torch.Generator().manual_seed(0)
    assert set(next_token(log_probs, top_k=2, generator=g).tolist()) == {0, 1}
    p = log_probs[0].exp()
    nucleus = next_token(log_probs, top_p=float(p[0] + p[1]) - 1e-6, generator=g)  # mass reached by tokens 0, 1
    assert set(nucleus.tolist()) == {0, 1}
    assert set(next_token(log_probs, top_p=1e-3, generator=g).tolist()) == {0}
    assert set(next_token(log_probs, temperature=0).tolist()) == {0}
    counts = torch.bincount(next_token(log_probs, generator=g), minlength=5) / 4000
    torch.testing.assert_close(counts, p, atol=0.03, rtol=0)


@pytest.mark.parametrize("kind,options", CASES, ids=[variant_name(k, v) for k, v in CASES])
def test_the_cache_grows_as_tokens_come_not_to_max_new_tokens(kind, options, monkeypatch):
    """generate allocated T + max_new_tokens slots a layer up front: an eos at the first step with max_new_tokens
    =300000 held GBs at paper size. The bytes allocated must follow the tokens made."""
    model = _lm(kind, options, max_len=100_000)
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    eos = int(model.generate(idx[:1], 1, temperature=0)[0, -1])
    made = []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **k: made.append(new_cache(*a, **k)) or made[-1])
    out = model.generate(idx[:1], 60_000, temperature=0, eos=eos)
    assert out.shape[1] == 7  # ended by eos at the first step
    [cache] = made
    used = cache.nbytes()
    allocated = sum(layer.allocated_bytes() for layer in cache)
    assert allocated <= 4 * max(used, 1), (allocated, used)
    # and it still grows as far as the tokens go: the greedy continuation is the uncached one
    assert torch.equal(model.generate(idx, 40, temperature=0), _greedy_uncached(model, idx, 40))
