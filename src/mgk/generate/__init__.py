"""``mgk generate``: text continued by a trained language model of a run directory, through its decoding cache."""
