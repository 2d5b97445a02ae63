"""Models of the paper's experiments built on any registered attention kind."""
from .adaptive import TiedAdaptiveSoftmax, resolve_cutoffs
from .blocks import FeedForward, TransformerBlock
from .config import AttentionConfig, EncoderConfig, LMConfig
from .lm import IGNORE_INDEX, TransformerLM, sinusoidal_positions
from .lra import LRAClassifier, LRAEncoder, masked_mean
from .retrieval import RetrievalModel
from .tagger import TokenTagger

__all__ = ["FeedForward", "TransformerBlock", "LRAClassifier", "LRAEncoder", "masked_mean", "RetrievalModel"]
__all__ += ["TokenTagger"]
__all__ += ["IGNORE_INDEX", "TiedAdaptiveSoftmax", "TransformerLM", "resolve_cutoffs", "sinusoidal_positions"]
__all__ += ["AttentionConfig", "EncoderConfig", "LMConfig"]
