"""README's first examples run as written on a fresh clone without data and print what their comments say; its
generation example prompts only with words the generated corpus has (it used to prompt "The game began", which a
run on that corpus answers with `<unk> <unk> <unk>`). The Hugging Face example: tests/integrations/test_hf_readme.py."""
import contextlib
import io
import re
import shlex
from pathlib import Path

from mgk.config import apply_overrides
from mgk.data import wikitext as wt
from mgk.tasks import all_presets, get_task

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    return README.read_text().split(f"### {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_own_model_example_prints_its_comments(one_thread):
    code = re.search(r"```python\n(.*?)```", _section("MGK in your own model"), re.S).group(1)
    expected = [ln.split("#", 1)[1].strip() for ln in code.splitlines() if ln.startswith("print(")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {})
    assert printed.getvalue().splitlines() == expected


def test_the_generation_example_prompts_with_words_of_the_corpus_its_training_line_generates(tmp_path):
    section = _section("A language model, trained and generating")
    train, generate = (shlex.split(ln.split("#", 1)[0]) for ln in re.search(r"```bash\n(.*?)```", section, re.S)
                       .group(1).strip().splitlines())
    assert train[:2] == ["mgk", "train"] and "--data" not in train and generate[:2] == ["mgk", "generate"]
    assert generate[2] == train[train.index("--out") + 1]  # generates from the run the first line trained
    task = train[train.index("--task") + 1]
    cfg = apply_overrides(all_presets()[f"{task}-small"], task=task)  # the preset `mgk train --task lm` starts from
    data = get_task(task).prepare(cfg, tmp_path)  # what the run writes into run_dir/data without --data
    vocab = wt.Vocabulary.from_file(wt.find_split_file(data, "train"))
    prompt = generate[generate.index("--prompt") + 1].split()
    assert prompt and all(w in vocab and w != wt.UNK for w in prompt), prompt
    quoted = re.findall(r"`([a-z]+)`", section.split("so a prompt must use that corpus's words:", 1)[1][:200])
    assert quoted and all(w in vocab for w in quoted), quoted  # the words the text says the corpus has
