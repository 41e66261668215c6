"""Every random generator of the process (torch, CUDA, Python, NumPy): its state as plain data a checkpoint keeps,
and :func:`kept` around code that reseeds them for the process (an in-process vLLM engine, as it starts, seeds all
of them with its own seed)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every random generator the run draws from: torch (+CUDA) as tensors, Python and NumPy as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{index}"] = state
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    plain = {
        "python": [python_state[0], list(python_state[1]), python_state[2]],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("cuda_")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


@contextmanager
def kept() -> Iterator[None]:
    """Every generator's state as it was before the block, after it: the block's draws and reseeding leave the
    process's random streams where they were."""
    tensors, plain = rng_state()
    try:
        yield
    finally:
        set_rng_state(tensors, plain)
