"""One attention layer per kind, timed in turns within one process, for a before / after comparison of two
checkouts: it uses only ``mgk.bench.attention.build_kind``, which every checkout since the bench existed has, so
``PYTHONPATH=<checkout>/src python benchmarks/paired_layer.py ...`` measures that checkout's code with the same
harness. (``mgk bench attention --same-process`` does the same inside one checkout.)

Prints one JSON object: per kind the median over rounds of the per-round median call time (ms), its min and max,
and the median over rounds of the ratio to the first kind in the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from mgk.bench.attention import build_kind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="softmax:8,mgk:4,smgk:4")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=9, help="timed calls per kind per round")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kinds = [(k, int(h)) for k, h in (item.split(":") for item in a.kinds.split(","))]
    torch.manual_seed(0)
    x = torch.randn(a.batch, a.length, a.embed_dim, requires_grad=a.backward)
    calls = []
    for kind, heads in kinds:
        m = build_kind(kind, heads, a.embed_dim, a.head_dim, a.length).train(a.backward)

        def call(m=m):
            if a.backward:
                out, _ = m(x, need_weights=False, is_causal=True)
                out.sum().backward()
            else:
                with torch.no_grad():
                    m(x, need_weights=False, is_causal=True)
        for _ in range(3):
            call()
        calls.append(call)
    rounds = [[] for _ in kinds]
    for _ in range(a.rounds):
        for i, call in enumerate(calls):
            times = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1000)
            rounds[i].append(statistics.median(times))
    rows = [{"kind": f"{k}:{h}", "time_ms": statistics.median(r), "time_ms_min": min(r), "time_ms_max": max(r),
             "paired_ratio": statistics.median(x / y for x, y in zip(r, rounds[0])), "round_ms": r}
            for (k, h), r in zip(kinds, rounds)]
    print(json.dumps({"settings": vars(a), "load_1min": os.getloadavg()[0], "torch": torch.__version__,
                      "rows": rows}))


if __name__ == "__main__":
    main()
