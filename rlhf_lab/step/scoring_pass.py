"""The scoring pass over a rollout's sampled tokens: the reference's log-probs, the trainer's own π_old, the KL terms.

The engine that sampled the tokens reports its own log-probs. Where those are not the numbers the training pass
will compute (another engine, another precision, a decode that rounds otherwise) the PPO ratio would be off from
the first step: under bfloat16 clipping fires at step 0 (GSPO's ε = 3e-4 clips nearly everything). So wherever
the engine's log-probs are not the trainer's (``generation.logprobs``: ``auto`` = an engine without ``trainer_logprobs`` or a
precision other than ``fp32``; ``trainer``; ``sampler``; and, for an engine that reports no logits, wherever a batch
reads them: :meth:`ScoringPlan.for_batch`) one no-grad pass of the training model gives π_old, the entropy
and the hidden states PPO's shared critic reads; the engine's log-probs stay as ``sampler_logprobs`` for the
sampler–trainer correction (``algorithm.tis_cap``) and the ``rollout/logprob_diff_*`` metrics.

Everything runs over row chunks of ``trainer.logprob_chunk`` rows (0: the whole batch), or of up to
``trainer.max_tokens_per_micro_batch`` tokens, packed padding-free under ``trainer.pack_rows``: the [rows, T, V] logits of
a chunk die with it. Under ``trainer.chunked_logprobs`` no pass makes [rows, T, V] logits at all: they stay the LM
head's inputs (:class:`~rlhf_lab.scoring.head.HeadLogits`) and go through the head ``trainer.lm_head_chunk``
positions at a time. The exact KL from full logits (``kl.exact``: ``step``, ``eval``, ``off``) is computed per
chunk from the policy's and the reference's logits, so no [B, T, V] tensor is kept for it; the reference's logits
are kept only where the loss-placed estimator reads them (``full`` in the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.config.sweep_arms import single_update
from rlhf_lab.generation.decode import truncates
from rlhf_lab.generation.rollout import Rollout, Scored
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.masked import masked_mean
from rlhf_lab.models.loading import PolicyAndReference
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.head import HeadLogits, cat_head_logits
from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs
from rlhf_lab.step.ahead import sampled_behind
from rlhf_lab.step.compute import attention_implementation, head_chunk, micro_batches, packs_rows, token_budget


def sampler_differs(engine_class: Any, precision: Precision) -> bool:
    """Whether the engine's log-probs may not be the trainer's: an engine whose numbers are not the training model's
    own forward pass (its ``trainer_logprobs`` attribute: the ``hf`` engine's are), or a precision other than
    ``fp32`` (the decode and the training pass round otherwise)."""
    return not getattr(engine_class, "trainer_logprobs", False) or precision.name != "fp32"


def rescores(cfg: Any, differs: bool) -> bool:
    """Whether π_old comes from a scoring pass of the training model (``generation.logprobs``): ``trainer``, and
    always under ``algorithm.tis_cap`` (which corrects for the difference); ``sampler``: never; ``auto``: where
    the engine's numbers may not be the trainer's (``differs``, :func:`sampler_differs`) and the rollout gets more
    than one update (with a single update the training pass's own detached log-probs are π_old,
    :func:`single_update`), and always under ``generation.max_staleness=1`` (the sampler's numbers, entropies and
    exact KL are then a past policy's)."""
    source = cfg.generation.get("logprobs", "auto") if cfg.get("generation") else "auto"
    if source == "trainer" or cfg.algorithm.get("tis_cap") is not None:
        return True
    if source == "sampler":
        return False  # refused at compose time under truncation (rlhf_lab/config/validate_values.py)
    return sampled_behind(cfg) or (differs and not single_update(cfg))


@dataclass(frozen=True)
class BatchScoring:
    """Where one batch's π_old and entropy come from (:meth:`ScoringPlan.for_batch`)."""

    rescore: bool  # the training model's scoring pass gives π_old, the entropy and PPO's hidden states
    old_from_update: bool  # π_old is the training pass's own detached log-probs (one update per rollout)
    entropy_from_update: bool  # the training pass measures the entropy (an engine that reports none)


@dataclass(frozen=True)
class ScoringPlan:
    """Where a run's π_old, entropy and PPO's values come from, decided once at start-up from the config, the
    engine's capabilities (its class's attributes, never its name) and the precision; every batch asks
    :meth:`for_batch` and nothing else decides it."""

    rescore: bool  # every batch gets the training model's scoring pass (:func:`rescores`; multi-turn episodes too)
    old_from_update: bool  # one update per rollout with numbers that may differ: the training pass's are π_old
    engine_reports_logits: bool  # the engine's rollouts carry entropies, logits and hidden states (``reports_entropy``)
    keep_hidden: bool  # PPO's shared critic reads the sampling-time hidden states
    reads_logits: bool  # the KL estimator reads full logits
    one_update: bool  # :func:`single_update`

    @classmethod
    def from_config(cls, cfg: Any, engine_class: Any, precision: Precision, kl: KLPenalty, keep_hidden: bool,
                    episodes: bool) -> ScoringPlan:
        # Under top-k/top-p every engine's log-probs are of the truncated distribution q the tokens were drawn from,
        # not of the policy softmax(logits / T) the trainer trains: never π_old (kept as the sampler's μ for
        # algorithm.tis_cap and the KL's off-policy correction; docs/guides/generation.md).
        truncated = truncates(cfg.trainer.get("top_k", 0), cfg.trainer.get("top_p", 1.0))
        differs = sampler_differs(engine_class, precision) or truncated
        rescore = rescores(cfg, differs) or episodes  # an environment's turns are sampled apart: always rescored
        one_update = single_update(cfg)
        return cls(rescore=rescore, old_from_update=not rescore and differs and one_update,
                   engine_reports_logits=getattr(engine_class, "reports_entropy", True), keep_hidden=keep_hidden,
                   reads_logits=kl.reads_logits, one_update=one_update)

    def for_batch(self, exact: bool, train: bool) -> BatchScoring:
        """This batch's sources. The scoring pass runs where the plan says so, and, for an engine that reports no
        logits (vLLM), where the batch reads the policy's logits (``exact``: the exact KL; an estimator of full
        logits), PPO's sampling-time hidden states, or gets more than one update. A training batch with one
        update and none of these skips it: its training pass gives π_old and the entropy."""
        rescore = self.rescore
        if not self.rescore and not self.engine_reports_logits:
            rescore = exact or self.reads_logits or not train or self.keep_hidden or not self.one_update
        return BatchScoring(rescore, old_from_update=self.old_from_update and not rescore,
                            entropy_from_update=train and not rescore and not self.engine_reports_logits)


class ScoringPass:
    """Computes a scored batch's ``ref_logprobs``, ``kl_estimate`` and ``kl_exact`` (and, with ``rescore``,
    ``logprobs``, ``entropy`` and ``hidden`` from the training model, the engine's log-probs as ``sampler_logprobs``)
    and returns them; the experience puts them into its :class:`~rlhf_lab.generation.rollout.Scored` batch."""

    def __init__(self, cfg: Any, models: PolicyAndReference, policy: nn.Module, kl: KLPenalty,
                 device: torch.device, precision: Precision, keep_hidden: bool, logits_float32: bool) -> None:
        self.cfg, self.models, self.policy, self.kl, self.device = cfg, models, policy, kl, device
        self.precision = precision
        self.keep_hidden, self.logits_float32 = keep_hidden, logits_float32
        self.head_chunk = head_chunk(cfg.trainer, device)  # LM-head chunks of the log-probs (0: whole logits)
        self.pack = packs_rows(cfg.trainer, device, attention_implementation(policy))  # padding-free chunks (trainer.pack_rows)
        self.token_budget = token_budget(cfg.trainer, device)  # tokens per micro-batch (0: by rows)
        self.sharded = any(map(distributed.sharded, policy.parameters()))  # FSDP: ranks agree on chunk counts

    def __call__(self, rollout: Scored, timer: StepTimer, exact: bool, rescore: bool = False) -> dict[str, Any]:
        """The fields the scoring pass gives ``rollout`` (which it leaves as it is; the experience puts them in):
        ``ref_logprobs``, ``kl_estimate``, ``kl_exact`` (None unless ``exact``), ``ref_logits`` (None unless the
        loss reads them), ``policy_logits`` (None: the pass is done with them); with ``rescore`` the training
        model's pass too: ``logprobs``, ``entropy``, ``hidden`` and the engine's log-probs as ``sampler_logprobs``."""
        groups = micro_batches(rollout.attention_mask, self.cfg.trainer.logprob_chunk,
                               self.token_budget, agree=self.sharded,
                               stretch=self.cfg.trainer.get("max_tokens_per_micro_batch") is None, padded=not self.pack)
        pieces: dict[str, list[Tensor]] = {}
        for rows in groups:
            part = rollout if len(groups) == 1 else rollout.select(rows.to(rollout.input_ids.device))
            scored: dict[str, Any] = {}
            if rescore:
                scored.update(self._policy_pass(part, timer))
            scored.update(self._reference_pass(part, timer))
            part = replace(part, **scored)
            with timer.phase("kl"):
                scored["kl_estimate"], scored["kl_exact"] = self.kl.sampled_terms(part, exact=exact)
            keep = ["ref_logprobs", "kl_estimate", "kl_exact"]
            keep += ["logprobs", "entropy", "hidden"] if rescore else []
            keep += ["ref_logits"] if self.kl.loss_reads_ref_logits else []
            for key in keep:
                value, earlier = scored[key], pieces.setdefault(key, [])
                if isinstance(value, HeadLogits) and earlier:  # the pass's weights are one (under FSDP one copy)
                    value = replace(value, weight=earlier[0].weight, bias=earlier[0].bias)
                earlier.append(value)
            del part, scored  # the chunk's [rows, T, V] logits die here
        fields_ = {key: None if values[0] is None else values[0] if len(values) == 1 else
                   cat_head_logits(values) if isinstance(values[0], HeadLogits) else torch.cat(values)
                   for key, values in pieces.items()}
        fields_.setdefault("ref_logits", None)
        fields_["policy_logits"] = None
        if rescore:
            fields_["sampler_logprobs"] = rollout.logprobs  # the engine's; the trainer's are π_old
        return fields_

    def _policy_pass(self, part: Scored, timer: StepTimer) -> dict[str, Any]:
        """The training model's own log-probs (π_old), entropy, logits and hidden states of the sampled tokens."""
        mask = part.response_mask
        with timer.phase("policy_logprobs"), torch.no_grad(), self.precision.autocast():
            logits, hidden = response_logits(self.policy, part.input_ids, part.attention_mask, part.prompt_width,
                                             self.cfg.trainer.temperature, output_hidden_states=self.keep_hidden,
                                             float32=self.logits_float32, head_chunk=self.head_chunk, pack=self.pack)
            logprobs = gather_logprobs(logits, part.response_ids) * mask
            entropy = entropy_from_logits(logits) * mask
        return {"logprobs": logprobs, "entropy": entropy, "policy_logits": logits, "hidden": hidden}

    def _reference_pass(self, part: Scored, timer: StepTimer) -> dict[str, Any]:
        """The reference's logits and log-probs: the adapter-disabled policy under LoRA, else the frozen copy (on
        host memory between passes with ``trainer.offload_reference``: rlhf_lab/models/offload.py; FSDP moves its
        offloaded shards itself)."""
        model = self.models.reference_model()
        with timer.phase("reference"), torch.no_grad(), self.models.reference_context(), self.precision.autocast(), \
                self.models.reference_on_device():
            ref_logits, _ = response_logits(model, part.input_ids, part.attention_mask, part.prompt_width,
                                            self.cfg.trainer.temperature, float32=self.logits_float32,
                                            head_chunk=self.head_chunk, pack=self.pack)
            ref_logprobs = gather_logprobs(ref_logits, part.response_ids) * part.response_mask
        return {"ref_logits": ref_logits, "ref_logprobs": ref_logprobs}


def sampler_metrics(rollout: Rollout) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's, over every rank's tokens: the mean and largest
    |log π_trainer − log π_sampler| (``rollout/logprob_diff_mean|max``); {} where nothing was rescored."""
    if rollout.sampler_logprobs is None:
        return {}
    mask = rollout.response_mask
    difference = (rollout.logprobs - rollout.sampler_logprobs).abs() * mask
    return {"rollout/logprob_diff_mean": masked_mean(difference, mask, across_ranks=True).item(),
            "rollout/logprob_diff_max": distributed.maximum(difference.max())}
