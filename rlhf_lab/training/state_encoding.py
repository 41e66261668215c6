"""What a checkpoint stores as plain data: nested optimizer/scheduler states split into JSON and tensors
(safetensors), and every random generator's state (torch, CUDA, Python, NumPy)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch


# ----------------------------------------------------------------------------- plain-data encoding
def encode_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able form of a nested state dict; its tensors move into ``tensors`` (for safetensors).

    Dicts keep non-string keys (an optimizer's parameter ids), tuples stay tuples and non-finite floats
    survive, so :func:`decode_state` returns an equal structure.
    """
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": key}
    if isinstance(value, dict):
        return {"dict": [[encode_state(k, tensors), encode_state(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"tuple": [encode_state(v, tensors) for v in value]}
    if isinstance(value, list):
        return [encode_state(v, tensors) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint (only tensors and plain data)")


def decode_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_state`."""
    if isinstance(value, list):
        return [decode_state(v, tensors) for v in value]
    if isinstance(value, dict):
        (kind, payload), = value.items()
        if kind == "tensor":
            return tensors[payload]
        if kind == "dict":
            return {decode_state(k, tensors): decode_state(v, tensors) for k, v in payload}
        if kind == "tuple":
            return tuple(decode_state(v, tensors) for v in payload)
        if kind == "float":
            return float(payload)
        raise ValueError(f"unknown encoded entry {kind!r}")
    return value


# ----------------------------------------------------------------------------- RNG
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


def rank_rng_state() -> dict[str, list[int] | None]:
    """This rank's own torch generators, as JSON: the CPU one, and its GPU's (None without CUDA). Every rank's
    are saved with a multi-process checkpoint, so each resumes its own draws."""
    cuda = torch.cuda.get_rng_state().tolist() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state().tolist(), "cuda": cuda}


def set_rank_rng_state(state: dict[str, list[int] | None] | list[int]) -> None:
    """Restore :func:`rank_rng_state`'s generators (a list: a checkpoint that kept the CPU one only)."""
    if isinstance(state, list):
        state = {"cpu": state, "cuda": None}
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
