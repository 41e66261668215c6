"""The chunked LM head under FSDP2 (gloo, 2 processes): the log-probs, entropy and exact KL of the sharded policy
through the head in chunks equal the whole logits', their gradients (reduce-scattered to each rank's shards) too; a
pass without gradient keeps a copy of the gathered weight, which outlives FSDP's reshard; the decode keeps the
head's inputs, not a [B, T, V] buffer."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import gloo_ranks

PROMPT, RESPONSE = 5, 7


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to the larger of 1 and ``b``'s largest magnitude (0: equal)."""
    return float((a - b).abs().max() / (1 + b.abs().max()))


def _run(rank: int, store: str, out: str) -> None:
    from rlhf_lab.generation.decode import decode, gathered_once
    from rlhf_lab.kl.exact import exact_kl
    from rlhf_lab.runtime import distributed
    from rlhf_lab.scoring.forward import response_logits
    from rlhf_lab.scoring.head import HeadLogits
    from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs

    gloo_ranks.join(rank, store)
    try:
        tokenizer = gloo_ranks.tiny_tokenizer()
        policy, reference = gloo_ranks.sharded_tiny_llama(tokenizer, 0), gloo_ranks.sharded_tiny_llama(tokenizer, 1)
        generator = torch.Generator().manual_seed(rank)  # each rank its own rows: the reduce-scatter sums them
        input_ids = torch.randint(3, 60, (4, PROMPT + RESPONSE), generator=generator)
        mask = torch.ones_like(input_ids)
        tokens = input_ids[:, PROMPT:]
        results: dict = {"types": [], "view_warnings": 0}

        def step(chunk: int):
            policy.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits, _ = response_logits(policy, input_ids, mask, PROMPT, 0.8, head_chunk=chunk)
                with torch.no_grad():
                    ref_logits, _ = response_logits(reference, input_ids, mask, PROMPT, 0.8, head_chunk=chunk)
                results["view_warnings"] += sum("view tensor" in str(w.message) for w in caught)
            results["types"].append((type(logits).__name__, type(ref_logits).__name__))
            logprobs, entropy = gather_logprobs(logits, tokens), entropy_from_logits(logits)
            kl = exact_kl(logits, ref_logits)
            (logprobs.sum() + 0.3 * entropy.sum() + 0.5 * kl.sum()).backward()
            grads = {name: p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
            values = [logprobs.detach(), entropy.detach(), kl.detach()]
            return values, grads, ref_logits

        chunked, chunked_grads, kept = step(chunk=3)
        whole, whole_grads, _ = step(chunk=0)  # (and a second forward and backward of the reference's peer)
        results["values"] = max(_close(a, b) for a, b in zip(chunked, whole, strict=True))
        results["grads"] = max(_close(chunked_grads[n], g) for n, g in whole_grads.items())
        results["resharded"] = all(distributed.sharded(p) for p in policy.parameters())
        # The reference's kept chunked logits after both models' passes (and a reshard of the reference's weights):
        reference.reshard()
        with torch.no_grad():
            again, _ = response_logits(reference, input_ids, mask, PROMPT, 0.8, head_chunk=0)
        reference.reshard()
        results["kept"] = _close(gather_logprobs(kept, tokens), gather_logprobs(again, tokens))

        def sample(chunk: int):
            policy.eval()
            torch.manual_seed(3)
            with torch.no_grad(), gathered_once(policy):
                policy(input_ids=input_ids[:, :PROMPT])  # gathered before the decode, as a shared prompts' prefill
                sampled = decode(policy, input_ids[:, :PROMPT], mask[:, :PROMPT], None, 0, max_new_tokens=4,
                                 temperature=0.7, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0,
                                 keep_logits=True, head_chunk=chunk)
            return sampled

        lazy, full = sample(chunk=2), sample(chunk=0)
        results["decode_kept"] = type(lazy.logits).__name__
        results["decode_ids"] = torch.equal(lazy.response_ids, full.response_ids)
        results["decode"] = _close(lazy.logits.materialize(), full.logits)  # read after the decode's reshard
        results["decode_resharded"] = all(distributed.sharded(p) for p in policy.parameters())
        assert isinstance(kept, HeadLogits)
        gathered = [None, None]
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def test_the_chunked_head_under_fsdp_gives_the_whole_logits_values_and_gradients(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    mp.spawn(_run, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    for results in torch.load(out, weights_only=False):
        assert results["types"] == [("HeadLogits", "HeadLogits"), ("Tensor", "Tensor")]  # chunked, then whole
        assert results["values"] < 1e-5 and results["grads"] < 1e-5, results
        assert results["resharded"]  # FSDP freed the gathered weights after the backward, as without chunks
        assert results["kept"] < 1e-5  # the reference's kept logits read its weight's copy, not freed memory
        assert results["view_warnings"] == 0
        assert results["decode_kept"] == "HeadLogits" and results["decode_ids"]
        assert results["decode"] < 1e-5 and results["decode_resharded"]
