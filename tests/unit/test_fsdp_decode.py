"""Under FSDP2 the decode gathers the weights once per generation, not once per token (gloo, 2 processes)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import gloo_ranks

GATHERS_PER_FORWARD = 3  # two decoder blocks and the root, each its own FSDP group


def _generate(rank: int, store: str, out: str) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    import rlhf_lab.generation.hf as hf
    from rlhf_lab.runtime import distributed

    gloo_ranks.join(rank, store)
    try:
        tokenizer = gloo_ranks.tiny_tokenizer()
        model = gloo_ranks.sharded_tiny_llama(tokenizer)
        calls = {"gathers": 0}
        original = _fsdp_collectives.DefaultAllGather.__call__

        def counted(self, *args, **kwargs):
            calls["gathers"] += 1
            return original(self, *args, **kwargs)

        _fsdp_collectives.DefaultAllGather.__call__ = counted
        results = {}
        for name, context in (("once", hf.gathered_once), ("per_token", lambda model: nullcontext())):
            hf.gathered_once = context
            calls["gathers"] = 0
            torch.manual_seed(rank)
            rollout = hf.generate(model, tokenizer, ["Hi there", "Tell me more"], 2, 6, 1.0, 1.0, 0, 64,
                                  keep_logits=False)
            results[name] = {"gathers": calls["gathers"], "ids": rollout.response_ids.tolist(),
                             "resharded": all(distributed.sharded(p) for p in model.parameters())}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_the_decode_gathers_the_sharded_weights_once(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    mp.spawn(_generate, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    results = torch.load(out, weights_only=True)
    steps = len(results["once"]["ids"][0])
    assert steps > 1
    assert results["once"]["gathers"] == GATHERS_PER_FORWARD  # the first forward's, then none
    # Without it every block gathers again at every step (the root keeps its own weights between forwards).
    assert results["per_token"]["gathers"] >= (GATHERS_PER_FORWARD - 1) * steps
    assert results["once"]["ids"] == results["per_token"]["ids"]  # the same samples
    assert results["once"]["resharded"]  # every shard freed again after the generation
