"""What a checkpoint stores as plain data: nested optimizer/scheduler states split into JSON and tensors
(safetensors), and each rank's torch generators (every generator of the process: :mod:`rlhf_lab.runtime.random_state`)."""

from __future__ import annotations

import math
from typing import Any

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


# ----------------------------------------------------------------------------- this rank's generators
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
