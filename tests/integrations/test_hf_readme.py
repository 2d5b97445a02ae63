"""README's Hugging Face example runs as written and generates what its last comment says."""
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="README's Hugging Face example needs transformers: pip install -e '.[hf]'")

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_example_trains_a_swapped_llama_that_continues_the_count(one_thread):
    section = README.read_text().split("### Hugging Face models", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = eval(code.strip().splitlines()[-1].split("# prints", 1)[1])  # the comment on its last line
    torch.manual_seed(0)
    scope = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["out"][:, 5:].tolist() == expected
