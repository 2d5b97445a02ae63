"""Every Python snippet of README.md and docs/**/*.md runs as written and prints what its text says
(tests/doc_snippets.py: the markers, ``# prints`` comments and output blocks); the generation examples prompt only
with words of the corpus their training line generates (README once prompted "The game began", which a run on that
corpus answers with `<unk> <unk> <unk>`)."""
import re
import shlex

import pytest
import torch

from doc_snippets import check, markdown_files, snippets
from mgk.config import apply_overrides
from mgk.data import wikitext as wt
from mgk.tasks import all_presets, get_task

SNIPPETS = [s for path in markdown_files() for s in snippets(path)]


def _param(snippet):
    marks = [pytest.mark.slow] if snippet.slow else []
    return pytest.param(snippet, id=snippet.name, marks=marks)


def test_the_collector_finds_the_snippets_of_the_readme_and_the_docs():
    names = {s.path.name for s in SNIPPETS}
    assert {"README.md", "attention.md", "gqa.md", "decoding.md"} <= names, names
    assert sum(s.skip is None and s.slow is None for s in SNIPPETS) >= 8


@pytest.mark.parametrize("snippet", [_param(s) for s in SNIPPETS])
def test_the_snippet_runs_and_prints_what_its_text_says(snippet, one_thread, tmp_path, monkeypatch):
    if snippet.skip:
        pytest.skip(snippet.skip)
    if re.search(r"^\s*import .*\btransformers\b", "".join(code for _, code in snippet.parts), re.M):
        pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes lands in a temporary folder, not in the repository
    torch.manual_seed(0)  # the printed numbers of a snippet that draws random weights are those of seed 0
    check(snippet)


def _generation_examples():
    """(file, section text, train argv, generate argv) of each bash block that trains an LM and generates from it."""
    for path in markdown_files():
        text = path.read_text()
        for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
            commands = block.group(1).replace("\\\n", " ").strip().splitlines()  # continued lines joined
            lines = [shlex.split(ln.split("#", 1)[0]) for ln in commands]
            train = next((a for a in lines if a[:2] == ["mgk", "train"] and "lm" in a), None)
            generate = next((a for a in lines if a[:2] == ["mgk", "generate"]), None)
            if train and generate and "--data" not in train and "--prompt" in generate:
                yield path, text[block.end():], train, generate


def test_the_generation_examples_prompt_with_words_of_the_corpus_their_training_line_generates(tmp_path):
    examples = list(_generation_examples())
    assert any(path.name == "README.md" for path, *_ in examples)
    data = None
    for path, after, train, generate in examples:
        assert generate[2] == train[train.index("--out") + 1], path  # generates from the run the first line trained
        task = train[train.index("--task") + 1]
        cfg = apply_overrides(all_presets()[f"{task}-small"], task=task)  # the preset `mgk train --task lm` takes
        data = data or get_task(task).prepare(cfg, tmp_path)  # what the run writes into run_dir/data without --data
        vocab = wt.Vocabulary.from_file(wt.find_split_file(data, "train"))
        prompt = generate[generate.index("--prompt") + 1].split()
        assert prompt and all(w in vocab and w != wt.UNK for w in prompt), (path, prompt)
        if "so a prompt must use that corpus's words:" in after:
            quoted = re.findall(r"`([a-z]+)`", after.split("so a prompt must use that corpus's words:", 1)[1][:200])
            assert quoted and all(w in vocab for w in quoted), (path, quoted)  # the words the text says it has
