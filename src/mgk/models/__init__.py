"""Models of the paper's experiments built on any registered attention kind."""
from .blocks import FeedForward, TransformerBlock
from .lra import LRAClassifier, LRAEncoder, masked_mean

__all__ = ["FeedForward", "TransformerBlock", "LRAClassifier", "LRAEncoder", "masked_mean"]
