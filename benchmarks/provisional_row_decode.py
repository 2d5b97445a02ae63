"""Per-step time of one MGK / sMGK layer decoding a batch of 4 while one row's centre is provisional (an empty slot
fed padding, or a row of one real token), against every row real; run it once per source tree to compare
(``PYTHONPATH=<tree>/src python benchmarks/provisional_row_decode.py [steps]``). One thread, so that two runs on a
shared machine compare. Not a test: the figures go to the report of the change that needs them."""
import sys
import time

import torch

import mgk

E, H, D, B, P = 256, 8, 32, 4, 64
CASES = ("all real", "all real, mask given", "one row empty", "one row one token")


def step_time(kind: str, case: str, steps: int) -> tuple[float, int]:
    """(microseconds per step, bytes of the cache's bookkeeping) over ``steps`` one-token steps after a prefill."""
    torch.manual_seed(0)
    m = mgk.build_attention(kind, E, H, head_dim=D, batch_first=True).eval()
    cache = m.new_cache(P + steps + 1)
    pad = torch.zeros(B, P, dtype=torch.bool)
    step_pad = None if case == "all real" else torch.zeros(B, 1, dtype=torch.bool)
    if case == "one row empty":
        pad[3] = True
    elif case == "one row one token":
        pad[3, :-1] = True
    if case.startswith("one row"):
        step_pad[3] = True  # the row gets padding at every step: its centre stays provisional
    token = torch.randn(B, 1, E)
    with torch.no_grad():
        m(torch.randn(B, P, E), past_key_values=cache, key_padding_mask=pad if pad.any() else None, is_causal=True,
          need_weights=False)
        warm = 20
        for i in range(steps):
            if i == warm:
                start = time.perf_counter()
            m(token, past_key_values=cache, key_padding_mask=step_pad, is_causal=True, need_weights=False)
    return (time.perf_counter() - start) / (steps - warm) * 1e6, cache.extra_bytes()


def main() -> None:
    torch.set_num_threads(1)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print(f"mgk from {mgk.__file__}, batch {B}, prefill {P}, {steps} steps, E {E}, H {H}, D {D}")
    for kind in ("mgk", "smgk"):
        first = None
        for case in CASES:
            us, extra = step_time(kind, case, steps)
            first = first or us
            print(f"{kind:5s} {case:22s} {us:8.1f} us/step {us / first:5.2f}x  bookkeeping {extra} bytes", flush=True)


if __name__ == "__main__":
    main()
