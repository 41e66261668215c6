"""Attention over the grouped key/value heads as they are, in CPU scoring passes (``hardware.grouped_kv``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# transformers' own switch: its SDPA attention passes the key/value heads to the kernel as they are
# (``enable_gqa``) instead of repeating them for every query head of their group.
GROUPED_KV_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"

@contextmanager
def grouped_kv_attention(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Scoring passes on CPU attend with the grouped key/value heads as they are.

    Under a padding mask transformers' SDPA attention repeats each key/value head for the query heads of its
    group (``repeat_kv``: 3× the keys and values for SmolLM2's 9 query and 3 key/value heads), and a pass
    with gradients keeps those copies for its backward pass; inside, it hands the kernel the heads as they are
    (transformers' ``TRANSFORMERS_SDPA_FORCE_GQA``; PyTorch's CPU kernel takes a mask with them). The attention
    output is the same bit for bit; the key/value gradients are summed over a group inside the kernel, equal to
    the repeated heads' to float rounding (in float32 an ulp or two at 100+ positions; under bfloat16 autocast
    summed before rounding instead of after). Not on other devices (CUDA's kernels take the grouped heads only
    without a mask and fall back to the math kernel with one), not while a layer recomputes its forward in the
    backward pass (gradient checkpointing: the recomputation runs outside this context), and the environment's
    own setting stands. Generation does not use it: the decode loop's numbers stay ``generate``'s.
    """
    if device.type != "cpu" or GROUPED_KV_SWITCH in os.environ \
            or any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        yield
        return
    os.environ[GROUPED_KV_SWITCH] = "1"
    try:
        yield
    finally:
        del os.environ[GROUPED_KV_SWITCH]
