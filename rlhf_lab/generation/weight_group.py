"""Weights from the trainer to an ``rlhf-lab serve`` server over a process group of two (``weight_sync=collective``).

The trainer's rank 0 (rank 0 of the group, which hosts its ``TCPStore``) and the server (rank 1) form a
``torch.distributed`` process group of their own, beside the trainer's: NCCL where both hold GPUs (the tensors go
GPU to GPU, as TRL's and OpenRLHF's weight broadcast), gloo otherwise (this is how the CPU tests run it). Each
weight is broadcast from rank 0 as three messages, so the receiver needs no list of names and shapes beforehand
and the sender streams (FSDP2 gathers one parameter at a time):

- a header of :data:`HEADER` int64 values: 1 (another weight follows; 0 ends the stream), the dtype's index in
  :data:`DTYPES`, the number of dimensions, the dimensions (up to 8), the name's length in bytes;
- the name, UTF-8 bytes;
- the weight's bytes (any dtype travels as uint8 and is viewed back).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int8)
MAX_DIMS = 8
HEADER = 3 + MAX_DIMS + 1
TIMEOUT = timedelta(minutes=30)


class WeightGroup:
    """One end of the trainer–server group: ``rank`` 0 sends, 1 receives."""

    def __init__(self, host: str, port: int, rank: int, backend: str) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight group backend={backend!r} is not valid; choose from: nccl, gloo")
        store = dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False)
        store = dist.PrefixStore("rlhf_lab_weights", store)
        self.rank, self.backend = rank, backend
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.group: Any = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)

    def _broadcast(self, tensor: Tensor) -> Tensor:
        self.group.broadcast([tensor], dist.BroadcastOptions()).wait()
        return tensor

    def send(self, name: str, tensor: Tensor) -> None:
        """Rank 0: one weight."""
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"{name} has {tensor.dim()} dimensions; a weight group sends at most {MAX_DIMS}")
        encoded = name.encode()
        dims = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
        header = [1, DTYPES.index(tensor.dtype), tensor.dim(), *dims, len(encoded)]
        self._broadcast(torch.tensor(header, dtype=torch.int64, device=self.device))
        self._broadcast(torch.tensor(list(encoded), dtype=torch.uint8, device=self.device))
        data = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
        self._broadcast(data)

    def end(self) -> None:
        """Rank 0: no more weights this time."""
        self._broadcast(torch.zeros(HEADER, dtype=torch.int64, device=self.device))

    def receive(self) -> list[tuple[str, Tensor]]:
        """Rank 1: every weight up to the end of the stream, as (name, tensor on this end's device)."""
        return list(self.stream())

    def stream(self) -> Iterator[tuple[str, Tensor]]:
        """Rank 1: the weights one at a time as they arrive (only the one being taken is held); a consumer that
        stops early leaves the rest unread, so the stream is always read to its end."""
        while True:
            header = self._broadcast(torch.empty(HEADER, dtype=torch.int64, device=self.device)).tolist()
            if header[0] == 0:
                return
            dtype, ndim = DTYPES[header[1]], header[2]
            shape, name_length = header[3:3 + ndim], header[-1]
            name = bytes(self._broadcast(torch.empty(name_length, dtype=torch.uint8, device=self.device)).tolist())
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            data = self._broadcast(torch.empty(size, dtype=torch.uint8, device=self.device))
            yield name.decode(), data.view(dtype).reshape(shape)
