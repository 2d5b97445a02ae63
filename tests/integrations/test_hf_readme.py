"""README's Hugging Face section: its example runs as written and generates what its last comment says, and it tells
a user to load a saved swapped model with the Auto classes, never the plain class, whose silent fallback to fresh
attention weights (docs/hf.md) is checked here too."""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    return README.read_text().split("### Hugging Face models", 1)[1].split("\n### ", 1)[0]


def test_the_readme_example_trains_a_swapped_llama_that_continues_the_count(one_thread):
    pytest.importorskip("transformers", reason="README's Hugging Face example needs transformers: pip install -e "
                                               "'.[hf]'")
    code = re.search(r"```python\n(.*?)```", _section(), re.S).group(1)
    expected = eval(code.strip().splitlines()[-1].split("# prints", 1)[1])  # the comment on its last line
    torch.manual_seed(0)
    scope = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["out"][:, 5:].tolist() == expected


def test_the_readme_says_to_load_with_the_auto_classes_never_the_plain_class():
    prose = " ".join(_section().split())  # line breaks as spaces
    assert ("Load a saved swapped model with the Auto classes after `import mgk.integrations.hf`, never with the "
            "plain class") in prose
    assert "`LlamaForCausalLM.from_pretrained(folder)` only warns and returns plain attention with fresh random " \
           "weights" in prose
    assert "(docs/hf.md#saving-and-loading)" in prose


def test_the_plain_class_loads_a_saved_swap_as_plain_attention_and_the_auto_class_as_saved(hf_model, tmp_path):
    """What the README's sentence warns of: the plain class gives transformers' attention with fresh weights."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    import mgk
    from mgk.integrations.hf import HFAttention

    model = mgk.swap_attention(hf_model("llama"), "mgk")
    model.save_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, HFAttention) for m in plain.modules())
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.equal(auto(input_ids=ids).logits, expected)
        assert not torch.allclose(plain(input_ids=ids).logits, expected, atol=1e-3)
