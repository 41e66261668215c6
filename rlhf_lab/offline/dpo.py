"""``algorithm=dpo``: direct preference optimisation and its variants on (prompt, chosen, rejected) pairs.

Rows come in pairs (chosen 2i, rejected 2i + 1). The reference is the initial model, or the policy with its
LoRA adapter disabled; its log-probs are computed once per batch, without gradient, before the update
(none for the reference-free ``simpo``). The loss (``algorithm.loss_type``, kind ``preference_loss``,
rlhf_lab/offline/losses.py) is averaged over the batch's pairs; metrics carry TRL's names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from rlhf_lab.algorithms.base import LossContext, LossResult, PolicyOutput
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.masked import masked_sum
from rlhf_lab.offline.data import Example
from rlhf_lab.offline.losses import PairLogps, chosen_nll, is_reference_free, preference_loss, preference_metrics
from rlhf_lab.offline.stage import OfflineStage, chunks, to_device
from rlhf_lab.registry import register
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs


def pair_logps(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> PairLogps:
    """Per-pair sequence log-probs from per-token ones [2N, T] laid out chosen, rejected, chosen, ..."""
    sequence = masked_sum(logprobs, mask, dim=-1)
    reference = masked_sum(ref_logprobs, mask, dim=-1) if ref_logprobs is not None else torch.zeros_like(sequence)
    lengths = mask.sum(-1)
    return PairLogps(chosen=sequence[0::2], rejected=sequence[1::2], ref_chosen=reference[0::2],
                     ref_rejected=reference[1::2], chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])


@register("algorithm", "dpo")
class DPO(OfflineStage):
    pairs = True

    @classmethod
    def min_group_size(cls, cfg: Any) -> int:
        return 2

    @torch.no_grad()
    def prepare(self, batch: Rollout, trainer: Any) -> Rollout:
        """The batch with the reference's per-token log-probs of both responses (zeros for a reference-free loss)."""
        if is_reference_free(self.cfg.loss_type):
            return replace(batch, ref_logprobs=torch.zeros_like(batch.response_mask))
        models = trainer.models
        with models.reference_context(), trainer.precision.autocast():
            logits, _ = response_logits(models.reference_model(), batch.input_ids, batch.attention_mask,
                                        batch.prompt_width, trainer.updater.temperature(trainer.cfg))
        return replace(batch, ref_logprobs=gather_logprobs(logits, batch.response_ids) * batch.response_mask)

    def pair_loss(self, logps: PairLogps) -> torch.Tensor:
        cfg = self.cfg
        return preference_loss(cfg.loss_type, logps, cfg.beta, cfg.label_smoothing, cfg.gamma, cfg.ipo_normalize,
                               cfg.nll_weight)

    def loss(self, batch: Rollout, output: PolicyOutput, context: LossContext) -> LossResult:
        """This micro-batch's share of the mean loss over the mini-batch's pairs, and of its metrics."""
        logps = pair_logps(output.logprobs, batch.ref_logprobs, batch.response_mask)
        pairs = max(context.minibatch_rows / 2, 1.0)
        loss = self.pair_loss(logps).sum() / pairs
        stats = {key: value / pairs for key, value in preference_metrics(self.cfg.loss_type, logps, self.cfg.beta).items()}
        stats["loss/dpo"] = loss.detach()
        if self.cfg.nll_weight > 0:  # the behaviour-cloning term's share, inside loss/dpo
            stats["loss/nll"] = chosen_nll(logps).detach().sum() / pairs
        return LossResult(loss, stats)

    @torch.no_grad()
    def held_out_metrics(self, trainer: Any, examples: list[Example]) -> dict[str, float]:
        sums: dict[str, float] = {}
        for part in chunks(examples):
            batch = to_device(trainer.collator.pairs(part), trainer.device)
            batch = self.prepare(batch, trainer)
            logps = pair_logps(trainer.updater.forward(batch).logprobs, batch.ref_logprobs, batch.response_mask)
            values = {"loss": self.pair_loss(logps).sum(), **preference_metrics(self.cfg.loss_type, logps, self.cfg.beta)}
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        return {f"eval/{key}": value / len(examples) for key, value in sums.items()} if examples else {}
