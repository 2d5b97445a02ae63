"""Dataset readers, encoders and synthetic generators for the Transformer-MGK experiments."""
