"""``mgk generate``: text continued by a trained language model of a run directory, through its decoding cache."""
from .load import LoadedRun, load_lm_run
from .text import decode_words, encode_prompt

__all__ = ["LoadedRun", "decode_words", "encode_prompt", "load_lm_run"]
