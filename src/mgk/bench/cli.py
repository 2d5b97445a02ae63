"""Argument parsing of ``mgk bench attention``, ``mgk bench model`` and ``mgk bench decode``."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..argtypes import number
from ..choices import argparse_type, unknown
from ..seeds import INT64_MAX
from .rows import MAX_TIMEOUT_S, busy_warning, load_line

DEFAULT_KINDS = "softmax:8,mgk:4,smgk:4,mgk-sdpa:4,mgk-hard:4,mgk-softe:4,linear:8,mlk:4,reference:4"


def _kinds(text: str) -> list[tuple[str, int]]:
    """--kinds: ``NAME:HEADS,...``, each NAME a registered kind, ``kind+option=value`` or a bench variant
    (:func:`mgk.bench.attention.variant`)."""
    from .attention import variant

    out = []
    for item in text.split(","):
        name, _, heads = item.strip().partition(":")
        if not heads.isdigit():
            raise SystemExit(f"--kinds: {item!r} is not NAME:HEADS (e.g. mgk:4)")
        if int(heads) < 1:
            raise SystemExit(f"--kinds: {item!r}: the number of heads must be >= 1")
        if int(heads) > INT64_MAX:
            raise SystemExit(f"--kinds: {item!r}: the number of heads must be <= {INT64_MAX} (a 64-bit integer)")
        try:
            variant(name)
            _check_heads(name, int(heads))
        except ValueError as e:
            raise SystemExit(f"--kinds: {e}") from None
        out.append((name, int(heads)))
    return out


def _check_heads(name: str, heads: int) -> None:
    """ValueError when the kind cannot be built with ``heads`` heads (e.g. gqa+num_kv_heads=3 with 8), before any row
    runs: a module of head size 1 is built (a few KB), so the module's own checks speak."""
    from .attention import build_kind

    if heads > 1024:  # more than any layer benchmarked here; the rows report what building it does
        return
    build_kind(name, heads, embed_dim=heads, head_dim=1, max_len=8)


def _model_kinds(text: str) -> list[tuple[str, int]]:
    """--kinds of ``bench model``: as ``bench attention``'s, without the variants that exist only as a module (a
    pinned backend, the authors' reference form)."""
    from .attention import variant

    kinds = _kinds(text)
    for name, _ in kinds:
        if variant(name).attention_only:
            raise SystemExit(f"--kinds: {name!r} exists only in `mgk bench attention`")
    return kinds


def _decode_kinds(text: str) -> list[tuple[str, int]]:
    """--kinds of ``bench decode``: as ``bench model``'s (a decoding cache is the module's, whatever its backend)."""
    return _model_kinds(text)


def _targets(text: str) -> list[str]:
    """--targets of ``bench decode``: ``layer`` and language-model presets."""
    from ..tasks import all_presets

    names = [t.strip() for t in text.split(",") if t.strip()]
    lm = sorted(n for n, cfg in all_presets().items() if cfg.task == "lm")
    for name in names:
        if name != "layer" and name not in lm:
            raise argparse.ArgumentTypeError(unknown("target", name, ["layer", *lm]))
    if not names:
        raise argparse.ArgumentTypeError("give at least one target")
    return names


def _task_names() -> list[str]:
    from ..tasks import TASKS

    return list(TASKS)


def _preset_names() -> list[str]:
    from ..tasks import all_presets

    return sorted(all_presets())


def _lengths(text: str) -> list[int]:
    """argparse type: comma-separated positive ints (the error names the option it came from: --lengths,
    --contexts, --batches)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be positive (>= 1), got {text}")
    if any(v > INT64_MAX for v in values):
        raise argparse.ArgumentTypeError(f"every value must be <= {INT64_MAX} (a 64-bit integer), got {text}")
    return values


def _positive(kind):
    """argparse type: a positive int or float, named in the error."""
    return number(kind, 0, low_open=True)


# --timeout of every bench: seconds a row may take, at most what a subprocess can wait (mgk.bench.rows).
_timeout = number(float, 0, MAX_TIMEOUT_S, low_open=True, note="seconds")


def _device(text: str) -> str:
    """--device: a torch device string that exists here."""
    from ..train.distributed import check_device

    try:
        check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _output_path(text: str) -> Path:
    """--json / --plot: refuse a path that cannot be written before the benchmark runs, not after."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {path.parent} is not a writable folder")
    return path


def _png_path(text: str) -> Path:
    """--plot: a writable path ending in .png (the figure is a PNG whatever the name says)."""
    if Path(text).suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text}: the figure is written as PNG; give a path ending in .png")
    return _output_path(text)


def add_parser(sub) -> None:
    """Register ``bench`` with its sub-commands on the ``mgk`` parser."""
    bench = sub.add_parser("bench", help="measure attention and model speed, memory and FLOPs")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    a = kinds.add_parser("attention", help="attention modules (with projections) across lengths")
    a.add_argument("--lengths", type=_lengths, default=_lengths("256,1024,4096,8192"),
                   help="sequence lengths N, comma-separated (default 256,1024,4096,8192)")
    a.add_argument("--batch", type=_positive(int), default=1, help="sequences per call (default 1)")
    a.add_argument("--embed-dim", type=_positive(int), default=256, help="the layer's width E (default 256)")
    a.add_argument("--head-dim", type=_positive(int), default=32, help="head size D of every kind (default 32)")
    # a string default goes through type= only when --kinds is not given (not on every `mgk` command's parser)
    a.add_argument("--kinds", type=_kinds, default=DEFAULT_KINDS, help=f"default {DEFAULT_KINDS}")
    a.add_argument("--causal", action="store_true", help="causal masking")
    a.add_argument("--backward", action="store_true", help="time forward + backward (default: forward only)")
    a.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32")
    a.add_argument("--repeats", type=_positive(int), default=5, help="timed calls per row (median reported)")
    a.add_argument("--same-process", action="store_true",
                   help="the kinds of each length in one process, taking turns for --rounds rounds; time is the "
                        "median of the round medians, x first the median of per-round ratios (no peak memory)")
    a.add_argument("--rounds", type=_positive(int), default=None,
                   help="rounds of --same-process (default 5; each kind makes --repeats calls per round)")
    a.add_argument("--device", type=_device, default="cpu", help="torch device to run on (default cpu)")
    a.add_argument("--timeout", type=_timeout, default=600.0,
                   help="seconds per row before it is reported as failed")
    a.add_argument("--json", type=_output_path, default=None, help="write the rows and machine facts here")
    m = kinds.add_parser("model", help="training/inference tokens per second and memory of a preset's model")
    m.add_argument("--task", default="listops", type=argparse_type("task", _task_names),
                   help="the task whose model is built (default listops)")
    m.add_argument("--preset", default=None, type=argparse_type("preset", _preset_names), help="default <task>-small")
    m.add_argument("--kinds", type=_model_kinds, default=None,
                   help="NAME:HEADS,... compared side by side, e.g. softmax:8,mgk:4 (default: the preset's own)")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset setting, as in mgk train (repeatable), e.g. --set grad_accum=4")
    m.add_argument("--steps", type=_positive(int), default=3, help="timed steps per row (median reported)")
    m.add_argument("--device", type=_device, default="cpu", help="torch device to run on (default cpu)")
    m.add_argument("--timeout", type=_timeout, default=3600.0,
                   help="seconds per row before it is reported as failed")
    m.add_argument("--json", type=_output_path, default=None, help="write the rows and machine facts here")
    _decode_parser(kinds)


def _decode_parser(kinds) -> None:
    from .decode import DEFAULT_KINDS as DECODE_KINDS
    from .decode import DEFAULT_TARGETS

    d = kinds.add_parser("decode", help="cached decoding: time per generated token, prefill time, cache bytes",
                         description="Per attention kind: prefill CONTEXT tokens through the decoding cache, then "
                                     "time single-token steps; report the cache's measured bytes beside the "
                                     "registry's formula. Targets: one attention layer and LM preset shapes "
                                     "(random weights), or a trained run with --run.")
    d.add_argument("--targets", type=_targets, default=None,
                   help=f"comma-separated: layer and/or LM presets (default {','.join(DEFAULT_TARGETS)})")
    d.add_argument("--kinds", type=_decode_kinds, default=None, help=f"default {DECODE_KINDS}")
    d.add_argument("--contexts", type=_lengths, default=_lengths("256,1024,4096"), help="default 256,1024,4096")
    d.add_argument("--batches", type=_lengths, default=_lengths("1,8"), help="default 1,8")
    d.add_argument("--steps", type=_positive(int), default=16, help="timed steps per row (median reported)")
    d.add_argument("--embed-dim", type=_positive(int), default=256, help="the layer target's width")
    d.add_argument("--head-dim", type=_positive(int), default=32, help="the layer target's head size")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the LM presets (e.g. vocab_size=1000)")
    d.add_argument("--run", default=None, metavar="RUN_DIR", help="measure this trained LM run instead of the "
                                                                  "targets (its own kind and heads)")
    d.add_argument("--rounds", type=_positive(int), default=1,
                   help="run the kinds of each cell in turn this many times and report the median with min-max "
                        "(default 1; 3 for figures to publish)")
    d.add_argument("--same-process", action="store_true",
                   help="build every kind of a cell in one process and alternate their steps round by round "
                        "(tighter ratios between kinds; by default each row runs in a fresh process)")
    d.add_argument("--compile", action="store_true",
                   help="also time each kind's step through torch.compile (inductor) over a cache of fixed "
                        "capacity, as generate(..., compile=True) runs it; its compiling first step is reported "
                        "apart")
    d.add_argument("--device", type=_device, default="cpu", help="torch device to run on (default cpu)")
    d.add_argument("--timeout", type=_timeout, default=1200.0,
                   help="seconds per row before it is reported as failed")
    d.add_argument("--json", type=_output_path, default=None, help="write the rows and machine facts here")
    d.add_argument("--plot", type=_png_path, default=None, metavar="PNG",
                   help="draw ms per token against the context, a line per kind, a panel per target and batch")


def _decode_header(result: dict, run_cfg) -> str:
    """The line above the table: machine, load, bandwidth and the sizes measured (the run's, with --run)."""
    st = result["settings"]
    if run_cfg is not None:
        m, a = run_cfg.model, run_cfg.attention
        sizes = (f"run {st['run_dir']}: {a.kind} x {a.num_heads} (head_dim {a.head_dim}), d_model {m.d_model}, "
                 f"{m.num_layers} layers, vocab {m.vocab_size}; baseline softmax x 8 of its sizes, random weights")
    else:
        sizes = (f"targets {','.join(st['targets'])}; layer width {st['embed_dim']}, head_dim {st['head_dim']}"
                 + (f"; --set {' '.join(st['overrides'])}" if st["overrides"] else ""))
    bw = result.get("read_bandwidth_gb_s")
    return (f"# {result['machine']}; torch {result['torch']}; {sizes}; steps {st['steps']}, rounds {st['rounds']}"
            f"{', kinds alternating in one process per cell' if st.get('same_process') else ''}; "
            f"{load_line(result)}; read bandwidth " + (f"{bw:.1f} GB/s" if bw else "not measured"))


def _print_header(result: dict, header: str) -> None:
    """The busy warning (stderr) when the machine was busy, then the line above the table: every bench's tables
    are read with the load they ran under."""
    warning = busy_warning(result)
    if warning:
        print(warning, file=sys.stderr)
    print(header)


def _run_decode(args) -> dict:
    from .decode import DEFAULT_KINDS, DEFAULT_TARGETS
    from .decode import run as run_decode
    from .decode import table as decode_table

    if args.run is not None:
        from ..train.rundir import RunFileError, load_config

        given = {"--targets": args.targets is not None, "--kinds": args.kinds is not None,
                 "--set": bool(args.overrides)}
        ignored = [flag for flag, yes in given.items() if yes]
        if ignored:  # the run's own model is measured: these would be dropped without a word
            raise SystemExit(f"--run measures the run's own model (its kind, heads and sizes): drop "
                             f"{' and '.join(ignored)}")

        try:
            cfg = load_config(args.run)
        except RunFileError as exc:
            raise SystemExit(f"--run: {exc}") from None
        if cfg.task != "lm":  # otherwise every row failed deep in the model, with a truncated AttributeError
            raise SystemExit(f"--run: {args.run} is a {cfg.task!r} run (a classifier): only language-model runs "
                             "(--task lm) decode")
        from .decode import check_run_positions

        try:
            check_run_positions(args.run, args.contexts, args.steps)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--run: {exc}") from None
    if args.overrides:
        from ..config import apply_overrides
        from ..tasks import all_presets

        try:
            apply_overrides(all_presets()["lm-small"], args.overrides)
        except ValueError as exc:
            raise SystemExit(_set_error(exc)) from None
    targets = ["run"] if args.run is not None else args.targets or list(DEFAULT_TARGETS)
    kinds = args.kinds if args.kinds is not None else _decode_kinds(DEFAULT_KINDS)
    result = run_decode(targets, kinds, args.contexts, args.batches, steps=args.steps, device=args.device,
                        timeout=args.timeout, embed_dim=args.embed_dim, head_dim=args.head_dim,
                        overrides=args.overrides, run_dir=args.run, rounds=args.rounds,
                        same_process=args.same_process, compile=args.compile)
    _print_header(result, _decode_header(result, cfg if args.run is not None else None))
    print(decode_table(result))
    if args.plot is not None and any("error" not in row for row in result["rows"]):
        from .plots import plot_decode

        print(f"figure: {plot_decode(result, args.plot)}")
    return result


def run(args) -> int:
    """Run the chosen benchmark, print its table and write the JSON when asked."""
    if args.bench_command == "decode":
        result = _run_decode(args)
        failed = [row for row in result["rows"] if "error" in row]
    elif args.bench_command == "attention":
        from .attention import run as run_attention
        from .attention import table

        if args.rounds is not None and not args.same_process:
            raise SystemExit("--rounds counts the rounds of --same-process: add --same-process (separate processes "
                             "measure each row once)")
        result = run_attention(args.kinds, args.lengths, batch=args.batch, embed_dim=args.embed_dim,
                               head_dim=args.head_dim, causal=args.causal, backward=args.backward,
                               dtype=args.dtype, repeats=args.repeats, device=args.device, timeout=args.timeout,
                               same_process=args.same_process, rounds=args.rounds or 5)
        _print_header(result, f"# {result['machine']}; torch {result['torch']}; {result['settings']}; "
                              f"{load_line(result)}")
        print(table(result))
        failed = [row for row in result["rows"] if "error" in row]
    else:
        from ..tasks import all_presets
        from .model import run as run_model
        from .model import table as model_table

        preset = args.preset or f"{args.task}-small"
        if preset not in all_presets():  # a task without a small preset: name the presets there are
            raise SystemExit(f"--preset: {unknown('preset', preset, sorted(all_presets()))}")
        from ..config import apply_overrides

        try:
            apply_overrides(all_presets()[preset], args.overrides)
        except ValueError as exc:
            raise SystemExit(_set_error(exc)) from None
        result = run_model(preset, args.overrides, kinds=args.kinds, steps=args.steps, device=args.device,
                           timeout=args.timeout)
        _print_header(result, f"# {result['machine']}; torch {result['torch']}; {result['settings']}; "
                              f"{load_line(result)}")
        print(model_table(result))
        failed = [row for row in result["rows"] if "error" in row]
    if args.json:
        from ..atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    if failed:
        print(f"mgk bench: {len(failed)} of {len(result['rows'])} rows failed (see the error column)")
        return 1
    return 0


def _set_error(exc: ValueError) -> str:
    """The one line of a bad ``--set``, naming the flag once (most config errors name it already)."""
    return str(exc) if str(exc).startswith("--set") else f"--set: {exc}"
