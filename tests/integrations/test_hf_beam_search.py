"""Beam search and assisted decoding on Hugging Face models whose attention mgk swapped in, for every registered kind
(kinds registered later included): ``generate(num_beams=3, use_cache=True)`` on a left-padded batch gives the
sequences and scores of ``use_cache=False`` (transformers reorders the cache by ``beam_idx`` after every step:
:meth:`mgk.attention.cache.LayerCache.reorder`); assisted decoding (the rejected draft tokens cropped off the
cache) gives greedy decoding's output for every kind with per-token entries, and transformers refuses it in one line
for a recurrent state, whose cache layer says it cannot be cropped."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.attention.registry import attention_kinds, get_kind  # noqa: E402
from mgk.integrations.hf import MGKCacheLayer  # noqa: E402

KINDS = attention_kinds()
SLOTTED = [k for k in KINDS if not get_kind(k).cache.recurrent]
RECURRENT = [k for k in KINDS if get_kind(k).cache.recurrent]
BEAMS = dict(num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
             return_dict_in_generate=True)


@pytest.fixture
def beam_indices(monkeypatch):
    """The ``beam_idx`` of every ``reorder_cache`` call on an mgk cache layer (the spy keeps the method's work)."""
    seen = []
    reorder = MGKCacheLayer.reorder_cache

    def spy(self, beam_idx):
        seen.append(beam_idx.tolist())
        return reorder(self, beam_idx)

    monkeypatch.setattr(MGKCacheLayer, "reorder_cache", spy)
    return seen


def _beams_with_and_without_cache(model, ids, mask, **settings):
    kw = {**BEAMS, **settings}
    cached = model.generate(ids, attention_mask=mask, use_cache=True, **kw)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=1e-5)
    return cached


@pytest.mark.parametrize("kind", KINDS)
def test_cached_beam_search_equals_uncached_left_padded(hf_model, batch, kind, beam_indices):
    model = mgk.swap_attention(hf_model("llama"), kind)
    ids, mask = batch
    out = _beams_with_and_without_cache(model, ids, mask, early_stopping=True)
    assert out.sequences.shape[0] == 2 and torch.equal(out.sequences[:, :9], ids)
    rows = list(range(6))
    assert any(index != rows for index in beam_indices)  # beams were moved, not only kept in place


def test_cached_beam_search_equals_uncached_on_gpt2(hf_model, batch):
    model = mgk.swap_attention(hf_model("gpt2"), "mgk")
    _beams_with_and_without_cache(model, *batch, early_stopping=False)


SETTINGS = {
    "gpt2": ("gpt2", {}),
    "never_stop_early": ("llama", {"early_stopping": "never"}),
    "two_beams": ("llama", {"num_beams": 2}),
    "four_beams_two_returned": ("llama", {"num_beams": 4, "num_return_sequences": 2}),
    "length_penalty": ("llama", {"length_penalty": 0.5, "max_new_tokens": 9}),
}


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_cached_beam_search_equals_uncached_in_more_settings(hf_model, batch, kind, setting):
    arch, settings = SETTINGS[setting]
    model = mgk.swap_attention(hf_model(arch), kind)
    _beams_with_and_without_cache(model, *batch, **settings)


def _assistant(hf_model, kind):
    """A one-layer model of the same vocabulary that drafts 4 tokens at every round, however unsure."""
    assistant = mgk.swap_attention(hf_model("llama", num_hidden_layers=1), kind)
    assistant.generation_config.assistant_confidence_threshold = 0.0
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant


@pytest.mark.parametrize("kind", SLOTTED)
def test_assisted_decoding_equals_greedy(hf_model, batch, kind, monkeypatch):
    crops = []
    crop = MGKCacheLayer.crop
    monkeypatch.setattr(MGKCacheLayer, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
    model = mgk.swap_attention(hf_model("llama"), kind)
    ids = batch[0][:1]  # assisted decoding takes one sequence
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assisted = model.generate(ids, assistant_model=_assistant(hf_model, kind), **kw)
    assert torch.equal(assisted, model.generate(ids, **kw))
    assert min(crops) < -1  # several rejected draft tokens were cropped off at once


@pytest.mark.parametrize("kind", RECURRENT)
def test_assisted_decoding_is_refused_for_a_recurrent_state(hf_model, batch, kind):
    model = mgk.swap_attention(hf_model("llama"), kind)
    with pytest.raises(ValueError, match="cropped") as err:
        model.generate(batch[0][:1], assistant_model=_assistant(hf_model, kind), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    assert "\n" not in str(err.value)
