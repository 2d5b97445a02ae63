"""The snippet collector (tests/doc_snippets.py) catches a changed printed line, an output block that does not match
and honours its markers; README is a front page (the set-up lines, the answer and its figure near the top) whose
numbers are those of results/cpu/kv-budget.md, as is the figure's data file."""
import csv
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from doc_snippets import ROOT, check, snippets

README = ROOT / "README.md"
FIGURE_DATA = ROOT / "results/cpu/kv-budget-summary.csv"


def _page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_a_printed_line_that_differs_from_its_comment_fails(tmp_path):
    good, changed = snippets(_page(tmp_path, "```python\nx = 2\nprint(x + 1)   # prints 3\n```\n\n"
                                              "```python\nfor i in range(3):\n    print(i)  # prints 3\n```\n"))
    check(good)
    with pytest.raises(AssertionError, match=r"page.md:8 prints '2', the text says '3'"):
        check(changed)  # the last value a line printed is checked, so a loop's line shows its last one


def test_an_output_block_is_compared_with_everything_printed(tmp_path):
    page = ("```python\nprint('a')\nprint('b')\n```\n\n```output\na\nb\n```\n\n"
            "```python\nprint('a')\n```\n```output\nb\n```\n")
    right, wrong = snippets(_page(tmp_path, page))
    check(right)
    with pytest.raises(AssertionError, match="its output block says"):
        check(wrong)


def test_markers_skip_mark_slow_and_continue_a_block(tmp_path):
    page = ("<!-- skip: needs WikiText-103 data -->\n```python\nraise SystemExit\n```\n\n"
            "<!-- slow: trains for a minute -->\n\n```python\nx = 1\n```\n\n"
            "<!-- continues -->\n```python\nprint(x + 1)  # prints 2\n```\n\n"
            "```bash\nnot python\n```\n")
    skipped, slow = snippets(_page(tmp_path, page))
    assert skipped.skip == "needs WikiText-103 data" and skipped.slow is None
    assert slow.slow == "trains for a minute" and [line for line, _ in slow.parts] == [9, 14]
    check(slow)  # the continued block runs in the namespace of the block it continues


def test_the_readme_is_a_front_page_with_the_set_up_lines_the_answer_and_its_figure_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200
    top = "\n".join(lines[:80])
    second = 'pip install torch==2.13.0 && pip install -e ".[test,gpu,hf]" && python -m pytest -q'
    for needed in ["python3 -m venv .venv && . .venv/bin/activate",
                   "pip install torch==2.13.0 && pip install -e . && mgk train", second,
                   "| **GQA-8 (kv 2)** |", "| **MGK-4** |", "](docs/kv-budget-cache.png)"]:
        assert needed in top, needed
    assert second in (ROOT / ".ci/run").read_text().splitlines()  # CI runs README's test command verbatim
    install = re.search(r"## Install\n\n```bash\n(.*?)```", top, re.S).group(1)
    assert install in (ROOT / "docs/getting-started.md").read_text()  # the site shows the same set-up lines
    assert (ROOT / "docs/kv-budget-cache.png").stat().st_size > 10_000


def test_the_docs_home_page_shows_readme_s_verdict_and_the_terms_it_rests_on():
    """docs/index.md had its own copy of the verdict table, which drifted (2 rows against README's 3), and neither
    defined D-retrieval or lm-small: README's block (the table and a definition of each task it names) is the one
    source, and the home page shows it verbatim."""
    text = README.read_text()
    block = text[text.index("| | the paper's claim |"):text.index("## Install")].strip()
    assert block in (ROOT / "docs/index.md").read_text()
    table = "\n".join(line for line in block.splitlines() if line.startswith("|"))
    for term in ("D-retrieval", "lm-small"):
        assert term in table and f"- **{term}**: " in block, term


def test_the_install_prose_describes_the_block_s_lines_in_their_order():
    """The prose called the block's second line "the first command"."""
    text = README.read_text()
    prose = re.search(r"## Install\n\n```bash\n.*?```\n\n(.*?)\n\n", text, re.S).group(1)
    said = [prose.find(words) for words in ("The first line makes a virtual environment",
                                            "second line, installs the package", "last line, installs the test")]
    assert -1 not in said and said == sorted(said), prose


def _figure_rows():
    with FIGURE_DATA.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_the_figure_data_are_the_numbers_of_the_results_files():
    # kv-budget.md's rows, and the grouped mixture keys of mixture-keys-at-gqa-cache.md
    results = "\n".join((ROOT / f"results/cpu/{name}.md").read_text()
                        for name in ("kv-budget", "mixture-keys-at-gqa-cache"))
    rows = _figure_rows()
    assert {r["task"] for r in rows} == {"dretrieval-d8", "lm-small"}
    for r in rows:
        # the results table's row: the name (bold or not), then mean ± std, n, ..., cache bytes
        row = re.search(rf"^\| \**{re.escape(r['row'])}\** \| \**{re.escape(r['mean'])} ± {re.escape(r['std'])}\**"
                        rf" \|.*\| \**{r['cache_bytes']}\** \|", results, re.M)
        assert row, f"{r['task']} {r['row']}: {r['mean']} ± {r['std']}, {r['cache_bytes']} B not in the results files"


def _round(number: str, places: int) -> str:
    """number as written, rounded half up (5.05 -> 5.1, as a reader rounds; float formatting gives 5.0)."""
    return str(Decimal(number).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP))


def test_the_readme_answer_table_rounds_the_figure_data():
    text = README.read_text()
    rows = _figure_rows()
    for name in {r["row"] for r in rows}:
        cells = {r["task"]: r for r in rows if r["row"] == name}
        if len(cells) < 2:
            continue  # softmax-2 and softmax-1 ran on D-retrieval only; the README's table leaves them out
        d8, lm = cells["dretrieval-d8"], cells["lm-small"]
        shown = name.replace(" (kv 1)", "")  # README calls it MQA-8
        want = (f"| {_round(d8['mean'], 3)} ± {_round(d8['std'], 3)} | {_round(lm['mean'], 1)} ± "
                f"{_round(lm['std'], 1)} | {d8['cache_bytes']} / {lm['cache_bytes']} |")
        lines = [ln.replace("**", "") for ln in text.splitlines()]
        assert f"| {shown} {want}" in lines, (name, want)


def test_the_api_reference_covers_every_public_name_and_package():
    import mgk

    pages = "\n".join(p.read_text() for p in (ROOT / "docs/reference").glob("*.md"))
    documented = set(re.findall(r"^::: ([\w.]+)", pages, re.M))
    for name in mgk.__all__:
        assert name == "__version__" and "mgk.__version__" in pages or f"mgk.{name}" in documented or \
            f"mgk.train.load.{name}" in documented, name  # load_run and LoadedRun are imported lazily from there
    packages = {p.parent.name for p in (ROOT / "src/mgk").glob("*/__init__.py")} | {"retrofit"}
    for package in packages:
        assert any(d == f"mgk.{package}" or d.startswith(f"mgk.{package}.") for d in documented), package

