"""A swapped model pickles as the original does (TEST_CASES R36): ``torch.save(model)``, ``pickle``, multiprocessing and
``copy.deepcopy`` fail on a module holding a local closure (a hook), so mgk's modules hold none; the model comes back
with identical outputs, in this process and in a fresh one. The original stops pickling once transformers has
installed its own output-capturing hooks (the first call with ``output_attentions`` / ``output_hidden_states``);
before that, wherever it pickles, the swapped model must."""
import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mgk.integrations.hf needs transformers: pip install "
                                                          "-e '.[hf]'")

import mgk  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt2", "bert")


def _pickles(model) -> bool:
    try:
        pickle.dumps(model)
    except (AttributeError, pickle.PicklingError, TypeError):
        return False
    return True


@pytest.mark.parametrize("kind", mgk.attention_kinds())
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_swapped_model_pickles_and_deep_copies_to_identical_outputs(hf_model, batch, arch, kind):
    ids, mask = batch
    model = mgk.swap_attention(hf_model(arch), kind)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(again) is type(model)
        with torch.no_grad():
            assert torch.equal(again(input_ids=ids, attention_mask=mask).logits, expected)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_swapped_model_pickles_wherever_the_original_does(hf_model, batch, arch):
    """Built, after a forward, after generating (causal models): the original pickles in each, so the swapped one
    must, and both generate the same tokens after the round trip (softmax)."""
    ids, mask = batch
    original = hf_model(arch)
    swapped = mgk.swap_attention(copy.deepcopy(original), "softmax")
    steps = [lambda m: None, lambda m: m(input_ids=ids, attention_mask=mask)]
    if arch != "bert":
        steps.append(lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    for step in steps:
        with torch.no_grad():
            step(original), step(swapped)
        assert _pickles(original)
        assert _pickles(swapped)
    if arch != "bert":
        again = pickle.loads(pickle.dumps(swapped))
        expected = original.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert torch.equal(again.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), expected)


_LOAD = """
import sys, torch
model, ids, expected = torch.load(sys.argv[1], weights_only=False)
with torch.no_grad():
    print(type(model).__name__, torch.equal(model(input_ids=ids).logits, expected))
"""


def test_torch_save_of_a_swapped_model_loads_in_a_fresh_process(hf_model, batch, tmp_path):
    """The mgk classes, the recording hook and the rotary function are found by name where the file is loaded."""
    ids, _ = batch
    model = mgk.swap_attention(hf_model("llama"), "mgk")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.save((model, ids, expected), tmp_path / "model.pt")
    src = os.path.join(os.path.dirname(mgk.__file__), os.pardir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path / "model.pt")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["MGKLlamaForCausalLM", "True"]
