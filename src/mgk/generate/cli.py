"""Argument parsing and the handler of ``mgk generate``."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..argtypes import number, seed

_count = number(int, 1)
_temperature = number(float, 0, note="(0 = greedy)")
_top_p = number(float, 0, 1, low_open=True)


def add_parser(sub) -> None:
    """Register ``generate`` on the ``mgk`` parser."""
    p = sub.add_parser("generate", help="continue a text with a trained language model (lm runs)",
                       description="Continue a prompt with RUN_DIR's language model (best checkpoint, else last): "
                                   "words in the run's own vocabulary (unknown words are read as <unk> and "
                                   "reported), one token at a time through the model's decoding cache, words out "
                                   "(<eos> printed as a line break). An empty prompt starts at a line boundary.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory made by `mgk train --task lm`")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, help="the prompt text (whitespace-separated words)")
    source.add_argument("--prompt-file", default=None, metavar="FILE",
                        help="read the prompt from FILE (UTF-8; every line that ends with a newline ends with <eos>)")
    p.add_argument("--max-new-tokens", type=_count, default=50, help="tokens to generate per sample (default 50)")
    p.add_argument("--temperature", type=_temperature, default=1.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=_count, default=None, help="sample from the K most likely tokens only")
    p.add_argument("--top-p", type=_top_p, default=None, help="sample from the smallest set of mass P (nucleus)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampling generator, 0 to 2**64 - 1 (default 0)")
    p.add_argument("--num-samples", type=_count, default=1, help="continuations of the prompt (default 1)")
    p.add_argument("--checkpoint", default="best", choices=["best", "last"], help="which checkpoint (default: best)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step (slow; the "
                                                           "reference the cache must equal)")
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (inductor) over a cache of fixed capacity: the first steps "
                        "compile (seconds to a minute), later ones may be faster (BENCHMARKS.md)")


def _prompt_text(args) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-file: {path} is not a file")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _generate(args) -> list[str]:
    """The samples' texts (prompt and continuation); notes about the prompt go to stderr."""
    if args.compile and args.no_cache:
        raise SystemExit("mgk generate: --compile compiles the cached step: drop --no-cache")
    from ..models.compiled_decode import CompileError
    from ..train.distributed import check_device
    from ..train.load import load_run
    from ..train.rundir import RunDirError, load_config

    try:
        text = _prompt_text(args)
        cfg = load_config(args.run_dir)
        if cfg.task != "lm":
            raise ValueError(f"{args.run_dir} is a {cfg.task!r} run (a classifier): only language-model runs "
                             "(--task lm) generate text")
        device = str(check_device(args.device)) if args.device else ("cuda" if torch.cuda.is_available() else "cpu")
        run = load_run(args.run_dir, checkpoint=args.checkpoint, device=device)
        tokenizer = run.tokenizer
        unknown = tokenizer.unknown_words(text)
        if unknown:
            shown = ", ".join(unknown[:10]) + (", ..." if len(unknown) > 10 else "")
            print(f"mgk generate: {len(unknown)} prompt word(s) not in the run's vocabulary, read as <unk>: {shown}",
                  file=sys.stderr)
        ids = tokenizer.encode(text) or [tokenizer.vocab.eos_id]  # an empty prompt starts at a line boundary
        idx = torch.tensor([ids] * args.num_samples, dtype=torch.int64, device=device)
        longest, trained = len(ids) + args.max_new_tokens - 1, run.cfg.data.segment_len
        if longest > trained:  # sinusoidal positions extrapolate, but nothing was trained on them
            print(f"mgk generate: warning: the model will read {longest} positions, past the {trained} it was trained "
                  "on (segment_len): its predictions there were never trained", file=sys.stderr)
        out = run.model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed),
                                 use_cache=not args.no_cache, compile=args.compile)
    except (FileNotFoundError, ValueError, RunDirError, CompileError) as e:
        raise SystemExit(f"mgk generate: {e}") from None
    return [tokenizer.decode(row.tolist()) for row in out]


def run(args) -> int:
    """Print each sample (separated by a header line when there are several)."""
    samples = _generate(args)
    for i, sample in enumerate(samples):
        if len(samples) > 1:
            print(f"--- sample {i + 1} of {len(samples)} ---")
        print(sample.rstrip("\n"))
    return 0
