"""What the two-process FSDP2 tests on gloo share: joining the group, and the tiny Llama each rank shards."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

DIMS = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)


def join(rank: int, store: str, world_size: int = 2) -> None:
    """This process as ``rank`` of a gloo group over the file ``store``, on one thread."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)


def tiny_tokenizer() -> Any:
    from rlhf_lab.models import loading

    return loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))


def sharded_tiny_llama(tokenizer: Any, seed: int = 0) -> torch.nn.Module:
    """The tiny Llama of ``seed`` (two blocks), sharded by the project's FSDP2 wrapping."""
    from rlhf_lab.models import loading
    from rlhf_lab.runtime import distributed

    return distributed.shard(loading.build_tiny_llama(tokenizer, DIMS, seed=seed))
