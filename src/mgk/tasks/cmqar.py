"""Compositional MQAR (Zoology's ``compositional_ar``; :mod:`mgk.data.mqar` with ``compositional=True``): every value
is bound to a compound key of two tokens, and neither half alone determines it. The task code is
:mod:`mgk.tasks.mqar`'s; this module fixes the form and the name."""
from __future__ import annotations

from pathlib import Path

from ..config import RunConfig
from . import mqar
from .mqar import MQARTask

__all__ = ["PRESETS", "prepare", "build", "restore", "check"]

# The plain preset's model and optimisation; 9 compound keys (a 3 x 3 grid) in 64 tokens: 27 context tokens and
# 12 query slots. How the sizes were chosen (softmax runs only): results/cpu/heads-exploration.md.
PRESETS = {"cmqar-small": mqar.small_preset("cmqar", gen_kv_pairs=9, gen_vocab=120)}


def prepare(cfg: RunConfig, run_dir: Path) -> Path:
    """:func:`mgk.tasks.mqar.prepare` of the compositional form."""
    return mqar.prepare(cfg, run_dir, compositional=True)


def build(cfg: RunConfig, data_dir: Path) -> MQARTask:
    """:func:`mgk.tasks.mqar.build` of the compositional form (ValueError for plain MQAR data)."""
    return mqar.build(cfg, data_dir, name="cmqar", compositional=True)


def restore(cfg: RunConfig, vocab=None) -> MQARTask:
    """:func:`mgk.tasks.mqar.restore` (the model does not depend on the form)."""
    return mqar.restore(cfg, vocab)


def check(cfg: RunConfig, data: Path) -> tuple[list[str], list[str]]:
    """:func:`mgk.tasks.mqar.check` of the compositional form."""
    return mqar.check(cfg, data, compositional=True)
