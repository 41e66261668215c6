"""``algorithm=sft``: supervised fine-tuning on demonstrations.

Loss: the token-mean negative log-likelihood of the response tokens, EOS included; prompt tokens carry no
loss (only positions that predict response tokens are scored). Held out: ``eval/loss`` and
``eval/perplexity`` = exp(loss), over unpacked rows. Training rows hold one demonstration each, or with
``algorithm.packing=true`` several, packed without cross-contamination (:mod:`rlhf_lab.offline.packing`):
the same loss, less padding. ``sft/packing_efficiency`` logs the share of the batch's token slots that hold
a token, packed or not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlhf_lab.algorithms.base import LossContext, LossResult, PolicyOutput
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.masked import masked_sum
from rlhf_lab.offline.data import Example
from rlhf_lab.offline.packing import PackedRows
from rlhf_lab.offline.stage import OfflineStage, chunks, to_device
from rlhf_lab.registry import register


def response_nll(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Σ −log π(token) over the response tokens [B, T] (a scalar; divide by the token count for the mean)."""
    return -masked_sum(logprobs, response_mask)


@register("algorithm", "sft")
class SFT(OfflineStage):
    pairs = False

    def collate(self, collator: Any, examples: list[Example]) -> Rollout:
        if self.cfg.packing:
            return collator.packed_demonstrations(examples, self.cfg.packing_length)
        return collator.demonstrations(examples)

    def batch_metrics(self, batch: Rollout) -> dict[str, float]:
        """The share of token slots holding a token (not padding), and response tokens per demonstration."""
        documents = batch.documents if isinstance(batch, PackedRows) else batch.batch_size
        return {
            "sft/packing_efficiency": float(batch.attention_mask.float().mean()),
            "response/length_mean": float(batch.response_mask.sum()) / max(documents, 1),
        }

    def loss(self, batch: Rollout, output: PolicyOutput, context: LossContext) -> LossResult:
        """This micro-batch's share of the mini-batch's token-mean NLL."""
        loss = response_nll(output.logprobs, batch.response_mask) / max(context.minibatch_tokens, 1.0)
        return LossResult(loss, {"loss/sft": loss.detach()})

    @torch.no_grad()
    def held_out_metrics(self, trainer: Any, examples: list[Example]) -> dict[str, float]:
        total, tokens = 0.0, 0.0
        for part in chunks(examples):
            batch = to_device(trainer.collator.demonstrations(part), trainer.device)
            output = trainer.updater.forward(batch)
            total += float(response_nll(output.logprobs, batch.response_mask))
            tokens += float(batch.response_mask.sum())
        if not tokens:
            return {}
        loss = total / tokens
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
