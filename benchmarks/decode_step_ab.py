"""MGK's decoding step on a base commit's tree and on the current one, timed in two long-lived worker processes that
take turns block by block (so that a busy machine's drift falls on both alike), with the median time per step of
each and their ratio (current / base).

Measurements per shape (``--what``): ``fn``, the functional :func:`mgk.functional.mgk_cache_step` at a fixed slot (the
steady state at S cached tokens: the arguments a layer's fused step passes), and ``layer``, one
``MGKAttention`` layer's forward of one new token through its cache (prefilled with S tokens, a fresh cache per
block so that S grows by one block only), and ``compiled``, that layer's step through torch.compile over the cache
fixed at its capacity (as ``generate(compile=True)``; compiled once per worker, S grows over the blocks).
Example (a few minutes on a busy 2-core machine)::

    python benchmarks/decode_step_ab.py --blocks 15 --kinds mgk,smgk --batches 1,8 --dims 16,32 --contexts 256,1024

Not a test: the figures go to the report of the change that needs them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "a79bc261034c95c3b1227a06b50dbb0e4dc3faca"

WORKER = r'''
import json, sys, time, statistics
import torch
from mgk.bench.attention import build_kind
from mgk.functional import mgk_cache_step

def setup(kind, B, H, D, S, what, steps):
    torch.manual_seed(0)
    cap = S + steps + 8
    module = build_kind(kind, H, H * D, D, max_len=cap).eval()
    with torch.no_grad():
        if what == "layer":
            prompt = torch.randn(B, S, H * D)
            token = torch.randn(B, 1, H * D)
            def block(n):
                cache = module.new_cache(cap)
                module(prompt, past_key_values=cache, is_causal=True, need_weights=False)
                for _ in range(3):
                    module(token, past_key_values=cache, is_causal=True, need_weights=False)
                out = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    module(token, past_key_values=cache, is_causal=True, need_weights=False)
                    out.append(time.perf_counter() - t0)
                return out
            return block
        if what == "compiled":  # the step traced over the cache fixed at its capacity (generate(compile=True))
            cap = S + 4000
            cache = module.new_cache(cap)
            module(torch.randn(B, S, H * D), past_key_values=cache, is_causal=True, need_weights=False)
            cache.fix_capacity(cap)
            token = torch.randn(B, 1, H * D)
            layer = lambda m, t, c: m(t, past_key_values=c, is_causal=True, need_weights=False)[0]
            fn = torch.compile(layer, fullgraph=True, dynamic=False)
            def block(n):
                out = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn(module, token, cache)
                    cache.advance(1)
                    out.append(time.perf_counter() - t0)
                return out
            return block
        cache = module.new_cache(cap)
        module(torch.randn(B, S, H * D), past_key_values=cache, is_causal=True, need_weights=False)
        module(torch.randn(B, 1, H * D), past_key_values=cache, is_causal=True, need_weights=False)
        buffers = cache._buffers
        shifted = module.keys == "shifted"
        q = torch.randn(B, H, 1, D)
        base = torch.randn(B, H, 1, D) if shifted else torch.randn(B, H, module.mixture.num_keys, 1, D)
        v = torch.randn(B, H, 1, D)
        opts = dict(sigma2=module.sigma2, mixture="max" if module.pi_mode == "hard_e" else "sum",
                    shifts=module.mixture.shifts() if shifted else None)
        log_pi = module.mixture.log_weights(1)
        slot = cache.length - 1
        def block(n):
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                mgk_cache_step(q, base, v, keys=buffers["keys"], key_bias=buffers["key_bias"],
                               values=buffers["values"], slot=slot, centre=cache.extra["centre"], key_valid=None,
                               log_pi=log_pi, **opts)
                out.append(time.perf_counter() - t0)
            return out
        return block

torch.set_num_threads(int(sys.argv[1]))
blocks = {}
for line in sys.stdin:
    cmd = json.loads(line)
    key = tuple(cmd["cell"])
    if key not in blocks:
        kind, B, H, D, S, what = key
        blocks[key] = setup(kind, B, H, D, S, what, cmd["steps"])
        with torch.no_grad():
            blocks[key](5)
    with torch.no_grad():
        times = blocks[key](cmd["steps"])
    print(json.dumps(statistics.median(times)), flush=True)
'''


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE)
    p.add_argument("--kinds", default="mgk,smgk")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dims", default="16,32")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--what", default="fn,layer")
    p.add_argument("--steps", type=int, default=40, help="steps per block (their median is the block's time)")
    p.add_argument("--blocks", type=int, default=15, help="alternations base / current (median of block medians)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each worker (default 1: on a busy machine a parallel step waits for a "
                        "descheduled thread, milliseconds, and those waits drown the difference measured)")
    return p.parse_args(argv)


def _worker(src: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(threads)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _ask(proc: subprocess.Popen, cmd: dict) -> float:
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker stopped (cell {cmd['cell']})")
    return json.loads(line)


def main(argv=None) -> int:
    args = _args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    cells = list(itertools.product(args.kinds.split(","), ints(args.batches), [args.heads], ints(args.dims),
                                   ints(args.contexts), args.what.split(",")))
    # a fixed folder per base commit: torch's extension cache keys the C++ build by its source path too
    tmp = Path(tempfile.gettempdir()) / f"mgk-decode-ab-{args.base[:12]}"
    if not (tmp / "src").is_dir():
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    workers = {"base": _worker(tmp / "src", args.threads), "now": _worker(ROOT / "src", args.threads)}
    print(f"{'kind':<5} {'B':>2} {'D':>3} {'S':>5} {'what':<6} {'base us':>8} {'now us':>8} {'now/base':>8}")
    try:
        for cell in cells:
            got = {"base": [], "now": []}
            for b in range(args.blocks):
                order = ("base", "now") if b % 2 == 0 else ("now", "base")
                for name in order:
                    got[name].append(_ask(workers[name], {"cell": cell, "steps": args.steps,
                                                          "blocks": args.blocks}))
            base, now = statistics.median(got["base"]), statistics.median(got["now"])
            kind, B, H, D, S, what = cell
            print(f"{kind:<5} {B:>2} {D:>3} {S:>5} {what:<6} {base * 1e6:>8.1f} {now * 1e6:>8.1f} "
                  f"{now / base:>8.3f}", flush=True)
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
