"""A frozen model kept in host memory between its passes (``trainer.offload_reference`` without FSDP).

Its weights are moved to host memory once, pinned where the device is a GPU (page-locked memory is what a copy to the
GPU can run from asynchronously; pageable memory is staged through a bounce buffer, synchronously). For a pass,
every weight is copied to the device with ``non_blocking=True`` (the copies queue behind each other on the stream, and
the pass's kernels after them); after it, the weights point at their host copies again and the device copies are
freed. Nothing is ever copied back: the weights are frozen, so the host copy is still theirs (``module.to("cpu")``
after each pass copied every weight back through pageable memory, and allocated it anew, every step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class HostWeights:
    """``module``'s parameters and buffers in (pinned, on a GPU run) host memory; :meth:`on_device` for a pass."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.device = device
        self.tensors = [*module.parameters(), *module.buffers()]  # tied weights once
        pin = device.type == "cuda"
        for tensor in self.tensors:
            host = tensor.data.to("cpu")
            tensor.data = host.pin_memory() if pin else host
        self.host = [tensor.data for tensor in self.tensors]

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """Within the block the weights are on the device; after it they are the host copies again."""
        for tensor, host in zip(self.tensors, self.host, strict=True):
            tensor.data = host.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            for tensor, host in zip(self.tensors, self.host, strict=True):
                tensor.data = host
