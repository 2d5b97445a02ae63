"""swap_attention keeps the model's mode in every module it puts in: from_pretrained returns a model in eval mode,
and a wrapper left in training mode made a forward with gradients enabled a training forward, so a hand-written
decoding loop without torch.no_grad() filled no cache and its next step attended to itself only (silently)."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402


@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert"))
@pytest.mark.parametrize("training", (False, True))
def test_every_module_of_a_swapped_model_is_in_the_models_mode(hf_model, arch, training):
    model = hf_model(arch).train(training)
    swapped = mgk.swap_attention(model, "mgk")
    modes = {type(m).__name__: m.training for m in swapped.modules() if m.training != training}
    assert not modes, f"modules not in the model's mode ({training}): {modes}"


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_decoding_with_gradients_enabled_in_eval_mode_fills_the_cache_and_refuses_the_step(hf_model, arch):
    """The documented eval-mode path: the first call's output is the uncached forward's and the cache is filled
    besides; a step that would record gradients is refused in one line (before: no cache, a silent wrong step)."""
    model = mgk.swap_attention(hf_model(arch).eval(), "softmax")
    ids = torch.randint(3, 40, (1, 7), generator=torch.Generator().manual_seed(0))
    cache = transformers.DynamicCache(config=model.config)
    model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)  # gradients enabled: no torch.no_grad()
    assert cache.get_seq_length() == 6
    with pytest.raises(ValueError, match=r"^past_key_values is for inference") as err:
        model(input_ids=ids[:, 6:], past_key_values=cache, use_cache=True)
    assert "\n" not in str(err.value)
    with torch.no_grad():
        step = model(input_ids=ids[:, 6:], past_key_values=cache, use_cache=True).logits[:, -1]
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
