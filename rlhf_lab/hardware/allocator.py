"""The C allocator's settings for a training process: freed memory stays in the heap for the next step.

A training step allocates and frees the same buffers every step: [B, V] float temporaries at every decode
step, [rows, V] chunks in the scoring passes, activations and gradients. glibc serves a request of more than
its mmap threshold with a fresh ``mmap`` and unmaps it on ``free``, and returns the top of the heap to the
kernel once more than its trim threshold is free there; the next step then page-faults the same memory in
again (with PyTorch's huge-page switch on, 2 MiB pages zeroed afresh). glibc raises the mmap threshold as
it goes, but only up to the size of a chunk it has freed, and every request PyTorch aligns for huge pages is
larger than the tensor. Here the mmap threshold is fixed at glibc's own upper bound for it (32 MiB: larger
tensors are still mapped and unmapped) and the heap is not trimmed. Peak memory does not grow: the freed
memory is reused by the next step's buffers.

Nothing changes where glibc is not the C library, or where the environment sets glibc's own malloc
switches (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc`` tunables in
``GLIBC_TUNABLES``): those stand. Mind that glibc stops adjusting both thresholds once either is set:
``MALLOC_TRIM_THRESHOLD_=131072`` alone maps every request over 128 KiB afresh (less peak memory, much slower
steps).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, i.e. never trim
USER_SWITCHES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def user_set() -> bool:
    """True when the environment sets glibc's own malloc switches (they are then left as they are)."""
    return any(name in os.environ for name in USER_SWITCHES) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def applies() -> bool:
    """True where :func:`keep_freed_heap` sets anything: on Linux, unless the environment sets glibc's switches."""
    return sys.platform.startswith("linux") and not user_set()


def keep_freed_heap() -> bool:
    """Fix glibc's mmap threshold at 32 MiB and turn off heap trimming; True when both took effect."""
    if not applies():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def preallocate_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments made now as its first step makes them (zeros, step 0), through its public state-dict
    format. Made before the first generation, they lie low in the heap instead of in the pieces the first
    backward pass leaves free, and the heap grows less around them. The first step finds them and updates as
    it would have."""
    state = optimizer.state_dict()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state["state"] = {index: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)} for index, p in enumerate(parameters)}
    optimizer.load_state_dict(state)
