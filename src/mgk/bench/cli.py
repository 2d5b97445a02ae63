"""Argument parsing of ``mgk bench attention`` and ``mgk bench model``."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_KINDS = "softmax:8,mgk:4,smgk:4,mgk-sdpa:4,mgk-hard:4,mgk-softe:4,linear:8,mlk:4,reference:4"


def _kinds(text: str) -> list[tuple[str, int]]:
    from ..attention import attention_kinds

    known = (*attention_kinds(), "mgk-hard", "mgk-softe", "mgk-sdpa", "reference")
    out = []
    for item in text.split(","):
        name, _, heads = item.strip().partition(":")
        if not heads.isdigit():
            raise SystemExit(f"--kinds: {item!r} is not NAME:HEADS (e.g. mgk:4)")
        if int(heads) < 1:
            raise SystemExit(f"--kinds: {item!r}: the number of heads must be >= 1")
        if name not in known:
            raise SystemExit(f"--kinds: unknown kind {name!r}; choose from {', '.join(known)}")
        out.append((name, int(heads)))
    return out


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths: {text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise SystemExit("--lengths must be positive")
    return values


def add_parser(sub) -> None:
    """Register ``bench`` with its two sub-commands on the ``mgk`` parser."""
    bench = sub.add_parser("bench", help="measure attention and model speed, memory and FLOPs")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    a = kinds.add_parser("attention", help="attention modules (with projections) across lengths")
    a.add_argument("--lengths", type=_lengths, default=_lengths("256,1024,4096,8192"))
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--embed-dim", type=int, default=256)
    a.add_argument("--head-dim", type=int, default=32)
    a.add_argument("--kinds", type=_kinds, default=_kinds(DEFAULT_KINDS), help=f"default {DEFAULT_KINDS}")
    a.add_argument("--causal", action="store_true", help="causal masking")
    a.add_argument("--backward", action="store_true", help="time forward + backward (default: forward only)")
    a.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a.add_argument("--repeats", type=int, default=5, help="timed calls per row (median reported)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--timeout", type=float, default=600.0, help="seconds per row before it is reported as failed")
    a.add_argument("--json", type=Path, default=None, help="write the rows and machine facts here")
    m = kinds.add_parser("model", help="training/inference tokens per second of a preset's model")
    m.add_argument("--task", default="listops")
    m.add_argument("--preset", default=None, help="default <task>-small")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--device", default="cpu")
    m.add_argument("--json", type=Path, default=None)


def run(args) -> int:
    """Run the chosen benchmark, print its table and write the JSON when asked."""
    if args.bench_command == "attention":
        from .attention import run as run_attention, table

        result = run_attention(args.kinds, args.lengths, batch=args.batch, embed_dim=args.embed_dim,
                               head_dim=args.head_dim, causal=args.causal, backward=args.backward,
                               dtype=args.dtype, repeats=args.repeats, device=args.device, timeout=args.timeout)
        print(f"# {result['machine']}; torch {result['torch']}; {result['settings']}")
        print(table(result))
    else:
        from .model import run as run_model

        preset = args.preset or f"{args.task}-small"
        result = run_model(preset, args.overrides, steps=args.steps, device=args.device, timeout=3600)
        for key, value in result.items():
            print(f"{key}: {value:,.1f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
