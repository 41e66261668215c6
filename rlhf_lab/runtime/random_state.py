"""Every random generator of the process kept around code that reseeds them: an in-process vLLM engine, as it
starts, seeds torch's, Python's and NumPy's generators with its own seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def kept() -> Iterator[None]:
    """The process's random streams as they were before the block, after it: torch's CPU generator and, where CUDA
    is in use, this process's device's (``torch.random.fork_rng``; not every GPU's, which would start a context on
    each), Python's and NumPy's."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)
