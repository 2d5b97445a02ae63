"""`mgk convert` end to end on a tiny Llama folder: the written folder loads through AutoModelForCausalLM in a fresh
process with the converted model's logits; a conversion that removes nothing starts at the source's perplexity;
recovery lowers the transfer loss and moves separate keys' components apart; a run killed with SIGKILL mid-run and
resumed ends bitwise as an uninterrupted one; bad input is one line with nothing written."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ARGS = ["--window", "16", "--batch-size", "2", "--checkpoint-every", "2"]


def _convert(th, source, data, out, *extra):
    return th.run(th.mgk_cmd("convert", str(source), "--data", str(data), "--out", str(out), "--quiet", *ARGS, *extra))


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model" / "model.safetensors"))


def test_a_conversion_loads_back_and_one_that_removes_nothing_keeps_the_perplexity(th, tiny_lm, tmp_path,
                                                                                  one_thread):
    source, data = tiny_lm
    out = tmp_path / "exact"
    _convert(th, source, data, out, "--kind", "gmgk", "--set", "num_kv_heads=3", "--eval-tokens", "256")
    results = json.loads((out / "results.json").read_text())
    src = th.run(th.mgk_cmd("score", str(source), "--text", str(data), "--tokens", "256", "--window", "16")).stdout
    want = float(src.split()[1])
    assert results["perplexity"]["step0"]["perplexity"] == pytest.approx(want, rel=1e-5)
    script = ("import sys, torch, transformers, mgk.integrations.hf\n"
              "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
              "ids = torch.arange(3, 19).view(1, 16)\n"
              "with torch.no_grad():\n"
              "    print(' '.join(x.hex() for x in m(ids).logits.flatten().tolist()))\n")
    fresh = subprocess.run([sys.executable, "-c", script, str(out / "model")], env=th.env(), capture_output=True,
                           text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    import transformers

    import mgk.integrations.hf  # noqa: F401
    here = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    with torch.no_grad():
        logits = here(torch.arange(3, 19).view(1, 16)).logits.flatten()
    assert fresh.stdout.split() == [x.hex() for x in logits.tolist()]  # bit for bit


def test_recovery_lowers_the_loss_and_moves_the_components_apart(th, tiny_lm, tmp_path):
    source, data = tiny_lm
    out = tmp_path / "recover"
    # the 3 groups pooled into one of 2 components (a lossy conversion), which start a spread of 1e-3 apart
    _convert(th, source, data, out, "--kind", "gmgk", "--set", "num_kv_heads=1", "--tokens", "640", "--e2e-tokens",
             "64", "--lr", "3e-3")
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 22 and results["transfer_loss"]["last"] < results["transfer_loss"]["first"]
    spread = results["component_spread"]
    assert spread["end"] > spread["start"] > 0, spread  # slowly (1 % here): see the test below and docs/retrofit.md


def test_identical_components_stay_identical_and_a_spread_grows(tiny_lm, tmp_path, monkeypatch):
    """Why the conversion spreads the components: without it (KEY_SPREAD = 0) every step of Adam keeps them equal
    to the last bit; with it they separate. In-process, through the Python API."""
    from mgk.attention import mixture_keys
    from mgk.recovery import ConvertConfig, convert

    source, data = tiny_lm
    cfg = ConvertConfig(str(source), "gmgk", {"num_kv_heads": 1}, data=str(data), tokens=320, window=16,
                        batch_size=2, lr=3e-3)
    spread = convert(cfg, tmp_path / "spread", progress=False)["component_spread"]
    monkeypatch.setattr(mixture_keys, "KEY_SPREAD", 0.0)
    equal = convert(cfg, tmp_path / "equal", progress=False)["component_spread"]
    assert equal == {"start": 0.0, "end": 0.0}
    assert spread["end"] > spread["start"] > 0


def test_a_killed_run_resumes_to_the_same_bits(th, tiny_lm, tmp_path):
    source, data = tiny_lm
    args = ["--kind", "gmgk", "--set", "num_kv_heads=1", "--set", "num_keys=3", "--tokens", "640", "--e2e-tokens",
            "128"]
    whole = tmp_path / "whole"
    _convert(th, source, data, whole, *args)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(th.mgk_cmd("convert", str(source), "--data", str(data), "--out", str(cut), "--quiet",
                                    *ARGS, *args), env=th.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = cut / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5:
            proc.send_signal(signal.SIGKILL)
            break
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (cut / "results.json").exists()
    th.run(th.mgk_cmd("convert", "--resume", str(cut), "--quiet"))
    a, b = _weights(whole), _weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 25))


@pytest.mark.parametrize("extra,match", [
    (["--kind", "gmgk", "--set", "num_kv_heads=4"], "num_kv_heads=4"),
    (["--kind", "mgk", "--set", "bogus=1"], "bogus"),
    (["--kind", "nope"], "--kind 'nope'"),
    (["--kind", "mgk", "--tokens", "100"], "tokens=100 is not a whole number of steps"),
    (["--kind", "mgk", "--tokens", "-5"], "--tokens"),
    (["--kind", "mgk", "--tokens", "ten"], "--tokens"),
])
def test_bad_settings_are_one_line_and_write_nothing(th, tiny_lm, tmp_path, extra, match):
    source, data = tiny_lm
    out = tmp_path / "never"
    p = subprocess.run(th.mgk_cmd("convert", str(source), "--data", str(data), "--out", str(out), *extra),
                       env=th.env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and match in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()


def test_a_source_or_out_that_is_not_what_it_should_be_is_one_line(th, tiny_lm, tmp_path):
    source, data = tiny_lm
    import transformers

    bert = tmp_path / "bert"
    transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=16)
                                 ).save_pretrained(bert)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    cases = [([str(bert), "--kind", "mgk", "--out", str(tmp_path / "a")], "not a causal language model"),
             ([str(tmp_path / "nothing"), "--kind", "mgk", "--out", str(tmp_path / "b")], "not a Hugging Face model"),
             ([str(source), "--kind", "mgk", "--out", str(occupied)], "not a conversion run folder"),
             (["--resume", str(occupied)], "not a conversion run folder")]
    for args, match in cases:
        p = subprocess.run(th.mgk_cmd("convert", *args, "--data", str(data)), env=th.env(), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode != 0 and match in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
