"""Tools beside the training path: ``bench`` (and its TRL harness) and ``report``."""
