"""Would a compiled decoding step pay on CPU? (the question behind the compiled decode path: where does it help?)

A stand-alone probe, not part of the package: a decoder of lm-small's sizes (d_model 128, 8 heads of 16, ffn 512,
pre-norm, a plain output layer over ``--vocab`` words) with softmax-8 attention, decoding greedily at batch
``--batch`` after a context of ``--context`` tokens, in three forms:

- ``filled``: eager, the new token's keys and values written into preallocated buffers and attention over the
  filled slots only (the form of mgk's caches);
- ``static``: eager, attention over the buffers' full capacity with a mask from a position tensor (gpt-fast's form,
  which a compiled step needs: shapes never change, so the graph is compiled once);
- ``compiled``: ``static`` through ``torch.compile(fullgraph=True, dynamic=False)`` (inductor; on CPU there are no
  CUDA graphs, so the gain is the fused elementwise work and the Python dispatch saved).

It checks that the three forms pick the same tokens, reports the compile time apart, and the median ms per token of
``--rounds`` rounds of ``--steps`` steps, the forms alternating round by round. Softmax only: if the plainest kind
gains little, the kinds with a cache of their own gain no more from compiling the same model around them.

    python benchmarks/compile_probe.py --context 256 --batch 1 --threads 1 [--layers 16] [--vocab 256] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

E, H, D, FF = 128, 8, 16, 512


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.qkv, self.o = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.f1, self.f2 = nn.Linear(E, FF), nn.Linear(FF, E)

    def mlp(self, x):
        return x + self.f2(F.gelu(self.f1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, layers: int):
        super().__init__()
        self.emb, self.ln, self.out = nn.Embedding(vocab, E), nn.LayerNorm(E), nn.Linear(E, vocab)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))


def step_filled(m, tok, kc, vc, slot: int):
    """slot: a Python int, the new token's slot; attention over slots [0, slot]."""
    x = m.emb(tok)
    B = x.shape[0]
    for i, layer in enumerate(m.layers):
        q, k, v = layer.qkv(layer.ln1(x)).view(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)
        kc[i][:, :, slot:slot + 1] = k
        vc[i][:, :, slot:slot + 1] = v
        a = F.scaled_dot_product_attention(q, kc[i][:, :, :slot + 1], vc[i][:, :, :slot + 1])
        x = layer.mlp(x + layer.o(a.transpose(1, 2).reshape(B, 1, E)))
    return m.out(m.ln(x))[:, -1].argmax(-1, keepdim=True)


def step_static(m, tok, kc, vc, pos):
    """pos: a (1,) long tensor, the new token's slot; attention over the full capacity, later slots masked."""
    x = m.emb(tok)
    B, T = x.shape[0], kc[0].shape[2]
    mask = (torch.arange(T, device=tok.device) <= pos).view(1, 1, 1, T)
    for i, layer in enumerate(m.layers):
        q, k, v = layer.qkv(layer.ln1(x)).view(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)
        kc[i].index_copy_(2, pos, k)
        vc[i].index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(q, kc[i], vc[i], attn_mask=mask)
        x = layer.mlp(x + layer.o(a.transpose(1, 2).reshape(B, 1, E)))
    return m.out(m.ln(x))[:, -1].argmax(-1, keepdim=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32487, help="output words (WikiText-103's lm-small vocabulary)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m = Decoder(a.vocab, a.layers).eval()
    capacity = a.context + a.steps * (a.rounds + 1) + 16

    def caches():
        g = torch.Generator().manual_seed(1)
        return ([torch.randn(a.batch, H, capacity, D, generator=g) for _ in m.layers],
                [torch.randn(a.batch, H, capacity, D, generator=g) for _ in m.layers])

    compiled = torch.compile(step_static, fullgraph=True, dynamic=False)
    forms = {"filled": lambda t, kc, vc, s: step_filled(m, t, kc, vc, s),
             "static": lambda t, kc, vc, s: step_static(m, t, kc, vc, torch.tensor([s])),
             "compiled": lambda t, kc, vc, s: compiled(m, t, kc, vc, torch.tensor([s]))}
    tok = torch.zeros(a.batch, 1, dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        forms["compiled"](tok, *caches(), a.context)
        compile_s = time.perf_counter() - t0
        tokens = {}
        for name, step in forms.items():
            kc, vc, t, seq = *caches(), tok, []
            for s in range(16):
                t = step(t, kc, vc, a.context + s)
                seq.append(t.flatten().tolist())
            tokens[name] = seq
        same = tokens["filled"] == tokens["static"] == tokens["compiled"]
        ms = {name: [] for name in forms}
        for _ in range(a.rounds):
            for name, step in forms.items():
                kc, vc, t = *caches(), tok
                t0 = time.perf_counter()
                for s in range(a.steps):
                    t = step(t, kc, vc, a.context + s)
                ms[name].append(1e3 * (time.perf_counter() - t0) / a.steps)
    med = {k: statistics.median(v) for k, v in ms.items()}
    result = {"args": vars(a), "compile_s": compile_s, "greedy_tokens_equal": same, "ms_per_token": ms,
              "median_ms_per_token": med, "x_filled": {k: v / med["filled"] for k, v in med.items()},
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"batch {a.batch}, context {a.context}, {a.layers} layers, vocab {a.vocab}, threads {a.threads}: "
          f"compile {compile_s:.1f} s, greedy tokens equal {same}")
    for k in forms:
        print(f"  {k:9s} {med[k]:.3f} ms/token  x filled {med[k] / med['filled']:.2f}  "
              f"(rounds {', '.join(f'{x:.3f}' for x in ms[k])})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
