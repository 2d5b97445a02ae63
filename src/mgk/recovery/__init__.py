"""Converting a pretrained causal language model into an attention kind and recovering it (`mgk convert`): the
models it starts from, the token windows, the recovery losses (local attention transfer, end-to-end distillation),
the resumable run and perplexity scoring (`mgk score`). Needs the ``hf`` extra (and ``convert`` for GGUF
checkpoints)."""
from .run import ConvertConfig, convert, read_run
from .score import perplexity
from .sources import WHEELS, load_source

__all__ = ["ConvertConfig", "WHEELS", "convert", "load_source", "perplexity", "read_run"]
