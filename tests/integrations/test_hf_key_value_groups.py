"""A kind with key/value groups (gqa, gmgk) on a model that already groups its keys keeps the model's groups unless
told otherwise (its cache stays as small), and after any swap the config states what the modules hold (heads,
key/value heads, head size), also in the folder save_pretrained writes and in the model loaded back from it."""
from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
from mgk.integrations.hf import HFAttention  # noqa: E402


def _attention(model):
    return [m.attn for m in model.modules() if isinstance(m, HFAttention)]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _held(model) -> tuple[int, int, int]:
    """(heads, key/value heads, head_dim) every swapped layer holds."""
    found = {(a.num_heads, getattr(a, "num_kv_heads", a.num_heads), a.head_dim) for a in _attention(model)}
    assert len(found) == 1
    return found.pop()


@pytest.mark.parametrize("kind", ["gqa", "gmgk"])
@pytest.mark.parametrize("keywords, held", [
    ({}, (4, 2, 8)),  # the Llama's own 2 groups of its 4 query heads
    ({"num_heads": 2}, (2, 2, 8)),  # fewer heads: the most groups that divide both
    ({"num_kv_heads": 4}, (4, 4, 8)),  # asked for: one group per head
])
def test_grouped_kinds_keep_the_model_s_groups_and_the_config_states_what_is_held(hf_model, tmp_path, kind, keywords,
                                                                                 held):
    model = mgk.swap_attention(hf_model("llama"), kind, **keywords)
    config = model.config
    assert _held(model) == held
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == held
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert _held(loaded) == held
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads, loaded.config.head_dim) == held
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(loaded, ids), _logits(model.eval(), ids))


def test_gqa_on_the_model_s_own_groups_is_the_model_and_its_cache_as_small(hf_model, batch):
    """G = the model's groups: each group's pooled key/value heads are the model's own, so the logits are kept."""
    ids, mask = batch
    original = hf_model("llama")
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask).logits
    model = mgk.swap_attention(original, "gqa")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        got = model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache}).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=0)
    # keys and values of 2 groups of head_dim 8, float32, per token and layer (the 2,304 against 4,608)
    assert cache.layers[0].nbytes() == 2 * 2 * 9 * 2 * 8 * 4


@pytest.mark.parametrize("arch, kind, keywords, held", [
    ("llama", "mgk", {}, (4, 4, 8)),  # one key/value head per query head (the grouped ones repeated)
    ("llama", "softmax", {"num_heads": 2}, (2, 2, 8)),
    ("gpt2", "softmax", {"num_heads": 2, "heads": "slice"}, (2, 2, 16)),  # the width kept: n_head can say it
    ("bert", "mgk", {"num_heads": 8, "heads": "slice"}, (8, 8, 4)),
])
def test_every_swap_leaves_the_config_stating_the_heads_held(hf_model, tmp_path, arch, kind, keywords, held):
    model = mgk.swap_attention(hf_model(arch), kind, **keywords)
    config = model.config
    assert _held(model) == held and config.num_attention_heads == held[0]
    if arch == "llama":
        assert (config.num_key_value_heads, config.head_dim) == held[1:]
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if arch == "bert" else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path).eval()
    assert _held(loaded) == held and loaded.config.num_attention_heads == held[0]
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_a_folder_saved_before_the_groups_were_kept_loads_as_it_was_saved(hf_model, tmp_path):
    """mgk 0.x wrote gqa on the grouped Llama with one group per head, no num_kv_heads in the record and the
    config's num_key_value_heads left at 2: that folder still loads, with its 4 groups."""
    import json

    model = mgk.swap_attention(hf_model("llama"), "gqa", num_kv_heads=4)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["mgk_attention"]["options"]["num_kv_heads"]
    config["num_key_value_heads"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert _held(loaded) == (4, 4, 8) and loaded.config.num_key_value_heads == 4
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(loaded, ids), _logits(model.eval(), ids))
