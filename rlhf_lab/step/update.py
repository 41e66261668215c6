"""The update: parameter groups, optimizer and schedule, epochs over mini-batches of micro-batches, guards.

:class:`Updater` owns everything that changes weights. Per step it runs ``algorithm.epochs`` passes over the
rollout in shuffled mini-batches of ``algorithm.mini_batch_size`` samples; each mini-batch accumulates the
gradients of micro-batches of ``trainer.micro_batch_size`` samples, or of up to ``trainer.max_tokens_per_micro_batch``
tokens, padded or packed (``trainer.pack_rows``), normalised by mini-batch totals so that the split does not change
the update (docs/concepts/architecture.md, "Invariance of the update"), then takes one optimizer step unless the algorithm vetoes it or the loss
or a gradient is not finite (a skip: parameters and optimizer state untouched, counted towards
``trainer.max_consecutive_skips``).

Under N processes (``trainer.strategy=ddp|fsdp``) each rank holds a contiguous block of whole prompt groups;
a mini-batch is ``algorithm.mini_batch_size / N`` rows on every rank, normalised by the mini-batch's global
token and row counts, and the loss is scaled by N because DDP and FSDP average gradients: the update equals
one process's on the whole batch. Vetoes, non-finite checks and statistics are reduced across ranks, so
every rank takes the same decision.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.algorithms.base import Algorithm, LossContext, LossResult, PolicyOutput, aggregate
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.models.recompute import checkpointed_layers, layers_checkpointing, recompute_modules, recomputing
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs, needs_float32_logits
from rlhf_lab.scoring.packing import packed_passes
from rlhf_lab.step.compute import attention_implementation, head_chunk, micro_batches, packs_rows, token_budget


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base learning rate at an optimizer step: linear warmup, then the schedule."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


EXTREMA = ("_max", "_min")  # statistics reduced by max / min instead of averaged


def combine_extremum(key: str, current: float | None, value: float) -> float:
    """The running max (``*_max``) or min (``*_min``) of a statistic."""
    if current is None:
        return value
    return max(current, value) if key.endswith("_max") else min(current, value)


def parameter_groups(policy: nn.Module, algorithm: Algorithm, lr: float) -> list[dict[str, Any]]:
    """The policy's trainable tensors at ``lr``, then the algorithm's own groups (a tensor appears once)."""
    policy_parameters = [p for p in policy.parameters() if p.requires_grad]
    seen = {id(p) for p in policy_parameters}
    groups = [{"params": policy_parameters, "lr": lr}]
    for group in algorithm.parameter_groups(lr):
        params = [p for p in group["params"] if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            groups.append({**group, "params": params})
    return groups


class Updater:
    """Optimizer, schedule and the epoch / mini-batch / micro-batch loop of one policy and its algorithm.

    ``kl`` adds its loss-placed term to every micro-batch's loss (None: no KL term, as in the offline stages).
    """

    def __init__(self, cfg: Any, policy: nn.Module, algorithm: Algorithm, kl: KLPenalty | None,
                 device: torch.device, precision: Precision | None = None, strategy: str = "single",
                 sync_modules: list[nn.Module] | None = None, hardware: HardwareProfile | None = None) -> None:
        self.cfg, self.policy, self.algorithm = cfg, policy, algorithm
        self.sync_modules = sync_modules or [policy]  # as the strategy wrapped them: DDP ones sync gradients
        self.kl = kl
        self.device = device
        self.hardware = hardware or HardwareProfile()
        self.precision = precision or Precision("fp32", device.type)
        self.scaler = self.precision.grad_scaler()
        self.world_size = distributed.world_size()
        trainer = cfg.trainer
        groups = parameter_groups(policy, algorithm, trainer.lr)
        self.parameters = [p for group in groups for p in group["params"]]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=trainer.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            weight_decay=trainer.weight_decay,
            # One fused kernel instead of per-tensor loops: the same update.
            fused=device.type in ("cpu", "cuda") and strategy != "fsdp",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(trainer.lr_schedule, trainer.warmup_steps, trainer.steps)
        )
        # Parts of each layer the backward runs again (trainer.recompute; null: the hardware profile's choice).
        self.recompute = recompute_modules(policy, trainer, auto=self.hardware.recompute)
        self.checkpointed = checkpointed_layers(policy)  # transformers' activation checkpointing, where enabled
        # The training pass's logits: float32 for an algorithm, or an estimator in the loss, that reads them (the
        # log-prob gather's gradients are the same bit for bit from the LM head's bf16 logits).
        self.logits_float32 = needs_float32_logits(
            self.temperature(cfg), getattr(algorithm, "reads_policy_logits", True),
            kl is not None and kl.in_loss and kl.reads_logits)
        self.head_chunk = head_chunk(trainer, device)  # LM-head chunks of the log-probs (0: whole logits)
        self.pack = packs_rows(trainer, device, attention_implementation(policy))  # padding-free micro-batches (trainer.pack_rows)
        self.token_budget = token_budget(cfg.trainer, device)  # tokens per micro-batch (0: by rows)
        self.sharded = any(map(distributed.sharded, policy.parameters()))  # FSDP: ranks agree on micro-batch counts
        if strategy != "fsdp":  # FSDP2's shards get their state at the first step
            self.hardware.prepare_optimizer(self.optimizer)
        algorithm.by_micro_batches = self.by_micro_batches  # its sampling-time passes cut as the training pass
        self.consecutive_skips = 0
        self.skipped_updates = 0
        self.last_grad_norm = float("nan")
        self.pass_entropy: Tensor | None = None  # the last update's measured entropy (``entropy_from_update``)

    # ------------------------------------------------------------------ counters (saved with checkpoints)
    def state_dict(self) -> dict[str, int]:
        return {"skipped_updates": self.skipped_updates, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_updates = state.get("skipped_updates", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)

    # ------------------------------------------------------------------ units
    @staticmethod
    def temperature(cfg: Any) -> float:
        """The temperature of the training pass's logits: the sampling temperature, so that π_θ is the policy
        that sampled the rollout (as π_old and the reference's log-probs are)."""
        return cfg.trainer.temperature

    def forward(self, batch: Rollout) -> PolicyOutput:
        """The policy's training forward pass over ``batch``: log-probs, logits (and hidden states if needed).

        Rows sharing a prompt share its prefill, except where the model keeps no key/value cache (under gradient
        checkpointing in training: :func:`~rlhf_lab.scoring.forward.cache_off`).
        """
        with self.precision.autocast():
            logits, hidden = response_logits(
                self.policy, batch.input_ids, batch.attention_mask, batch.prompt_width,
                self.temperature(self.cfg), output_hidden_states=self.algorithm.needs_hidden_states,
                float32=self.logits_float32, head_chunk=self.head_chunk, pack=self.pack,
            )
        logprobs = gather_logprobs(logits, batch.response_ids) * batch.response_mask
        return PolicyOutput(logprobs=logprobs, logits=logits, hidden=hidden)

    def micro_loss(self, batch: Rollout, context: LossContext, coef: float,
                   entropies: list[Tensor] | None = None) -> LossResult:
        """The algorithm's loss of a micro-batch plus the loss-placed KL term; ``loss/total`` in the stats. Where
        the training pass measures the sampling policy's entropy (``entropy_from_update``) the loss reads this pass's,
        appended to ``entropies``."""
        with recomputing(self.recompute), layers_checkpointing(self.checkpointed), packed_passes(self.pack):
            output = self.forward(batch)
        if batch.entropy_from_update:  # an engine with no logits, one update: the entropy of this very pass
            with torch.no_grad():
                batch = dataclasses.replace(batch, entropy=entropy_from_logits(output.logits.detach())
                                            * batch.response_mask)
            if entropies is not None:
                entropies.append(batch.entropy)
        with self.precision.autocast(), packed_passes(self.pack):  # the algorithm's own networks (a separate critic)
            result = self.algorithm.loss(batch, output, context)
        loss, stats = result.loss, result.stats
        kl_loss = None if self.kl is None else self.kl.loss_term(  # reduced like the policy loss
            output.logprobs, output.logits, batch, coef,
            reduce=lambda values, m: aggregate(values, m, self.cfg.algorithm.loss_aggregation, context))
        if kl_loss is not None:
            loss = loss + kl_loss
            stats["loss/kl"] = kl_loss.detach()
        stats["loss/total"] = loss.detach()
        return LossResult(loss, stats, result.veto, result.extrema)

    def optimizer_step(self, loss_finite: bool = True) -> bool:
        """Clip and apply gradients; skip (no parameter change) if the loss or any gradient is not finite."""
        max_norm = self.cfg.trainer.max_grad_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm if max_norm else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        self.last_grad_norm = float(grad_norm)
        if not loss_finite or not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()  # lowers the scale after an overflow
            self.consecutive_skips += 1
            self.skipped_updates += 1
            return False
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # spent: their memory serves the next generation instead
        self.consecutive_skips = 0
        return True

    def row_groups(self, batch: Rollout) -> list[Tensor]:
        """The rows of each micro-batch of ``batch``: ``trainer.micro_batch_size`` rows, or the token budget."""
        return micro_batches(batch.attention_mask, self.cfg.trainer.micro_batch_size, self.token_budget,
                             agree=self.sharded, stretch=self.cfg.trainer.get("max_tokens_per_micro_batch") is None,
                             padded=not self.pack)

    def by_micro_batches(self, batch: Rollout, fn: Any) -> Tensor:
        """``fn(part)`` ([rows, T]) over the micro-batches of ``batch`` (packed where the training pass packs), in
        row order: [B, T]."""
        groups = self.row_groups(batch)
        with packed_passes(self.pack):
            if len(groups) == 1:
                return fn(batch)
            return torch.cat([fn(batch.select(rows)) for rows in groups])

    def minibatch_update(self, minibatch: Rollout, coef: float, timer: StepTimer,
                         entropies: list[Tensor] | None = None) -> dict[str, float]:
        """Accumulate the micro-batches' gradients and take one optimizer step (or a veto, or a skip). Where the
        training pass measures the entropy, the mini-batch's rows' ([rows, T]) are appended to ``entropies``."""
        groups = self.row_groups(minibatch)
        # Rows count only with a response token: a dropped sample (mask zeroed) weighs nothing.
        local = torch.stack([minibatch.response_mask.sum().double(),
                             (minibatch.response_mask.sum(-1) > 0).sum().double()])
        tokens, rows = distributed.all_reduce_sum(local).tolist()
        context = LossContext(tokens, int(rows), self.cfg.trainer.max_new_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        # Accumulated on the device and read once per mini-batch (one host sync, not one per statistic and micro-batch).
        sums: dict[str, Tensor] = {}
        extremes: dict[str, Tensor] = {}
        veto_sum: Tensor | None = None
        finite: Tensor | None = None
        measured: list[Tensor] = []  # the micro-batches' entropies where the training pass measures them
        with timer.phase("policy_forward_backward"):
            for index, rows_index in enumerate(groups):
                # DDP all-reduces the gradients once, in the mini-batch's last backward.
                with distributed.no_sync(self.sync_modules, skip=index != len(groups) - 1):
                    micro_batch = minibatch.select(rows_index)
                    result = self.micro_loss(micro_batch, context, coef, measured)
                    loss_is_finite = torch.isfinite(result.loss.detach())
                    finite = loss_is_finite if finite is None else finite & loss_is_finite
                    self.backward(result.loss)
                for key, value in result.stats.items():
                    value = torch.as_tensor(value).detach().double()
                    sums[key] = sums[key] + value if key in sums else value
                for key, value in result.extrema.items():
                    value = torch.as_tensor(value).detach().double()
                    pick = torch.maximum if key.endswith("_max") else torch.minimum
                    extremes[key] = pick(extremes[key], value) if key in extremes else value
                if result.veto is not None:
                    veto = torch.as_tensor(result.veto).detach().double()
                    veto_sum = veto if veto_sum is None else veto_sum + veto
        stat_keys, extreme_keys = sorted(sums), sorted(extremes)
        values = torch.stack([sums[k].cpu() for k in stat_keys] + [extremes[k].cpu() for k in extreme_keys]
                             + [finite.double().cpu(), veto_sum.cpu() if veto_sum is not None else torch.zeros((),
                                                                                  dtype=torch.float64)]).tolist()
        stats = dict(zip(stat_keys, values))
        extrema = dict(zip(extreme_keys, values[len(stat_keys):]))  # ±inf where this rank had no valid token
        loss_finite, veto = values[-2] == 1.0, values[-1] if veto_sum is not None else None
        stats = distributed.sum_dict(stats)
        for key, value in extrema.items():  # over every rank's tokens; none anywhere: left out
            value = distributed.maximum(torch.tensor(value)) if key.endswith("_max") else \
                distributed.minimum(torch.tensor(value))
            if math.isfinite(value):
                stats[key] = value
        loss_finite = distributed.all_reduce_flags(loss_finite)
        with timer.phase("optimizer"):
            if veto is not None:
                veto = distributed.sum_dict({"veto": veto})["veto"]
            if veto is not None and veto > 0:  # the algorithm vetoed this mini-batch: drop its gradient
                self.optimizer.zero_grad(set_to_none=True)
                applied = True
            else:
                applied = self.optimizer_step(loss_finite)
        if veto is not None:
            stats["optim/vetoed"] = float(veto > 0)
        stats["optim/skipped"] = 0.0 if applied else 1.0
        if measured and entropies is not None:
            entropies.append(torch.cat(measured))
        return stats

    def backward(self, loss: Tensor) -> None:
        """Backward of a micro-batch's loss; ×N under N processes (DDP/FSDP average the gradients), scaled
        against float16 underflow under ``fp16-mixed``."""
        if self.world_size > 1:
            loss = loss * self.world_size
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def update(self, rollout: Rollout, coef: float, step: int, timer: StepTimer) -> dict[str, float]:
        """All epochs over ``rollout``; returns the update metrics averaged over mini-batches. Where the training
        pass measures the sampling policy's entropy (``rollout.entropy_from_update``) it is :attr:`pass_entropy`
        afterwards ([B, T]); the batch itself is not written."""
        cfg = self.cfg
        batch_size = rollout.batch_size  # this rank's rows
        mini = cfg.algorithm.mini_batch_size // self.world_size or batch_size
        sums: dict[str, float] = {}
        updates = 0
        self.last_grad_norm = float("nan")  # stays nan if no optimizer step runs this step (all vetoed)
        # Where the engine reports no entropy, the training pass measures it: the rows' entropies, in batch order.
        entropy = torch.zeros_like(rollout.entropy) if rollout.entropy_from_update else None
        self.pass_entropy = entropy
        generator = torch.Generator().manual_seed(cfg.seed * 7919 + step)
        for _epoch in range(cfg.algorithm.epochs):
            order = torch.randperm(batch_size, generator=generator) if mini < batch_size else torch.arange(batch_size)
            epoch_stats: dict[str, float] = {}
            for start in range(0, batch_size, mini):
                minibatch = rollout.select(order[start : start + mini])
                measured: list[Tensor] = []
                stats = self.minibatch_update(minibatch, coef, timer, measured)
                if measured:  # the sampling policy's entropy is this first pass's (one update)
                    entropy[order[start : start + mini]] = measured[0].to(entropy.dtype)
                updates += 1
                for key, value in stats.items():
                    if key.endswith(EXTREMA):
                        sums[key] = combine_extremum(key, sums.get(key), value)
                        continue
                    sums[key] = sums.get(key, 0.0) + value
                    epoch_stats[key] = epoch_stats.get(key, 0.0) + value
            n_minibatches = math.ceil(batch_size / mini)
            if self.algorithm.should_stop_epochs({k: v / n_minibatches for k, v in epoch_stats.items()}):
                break
        metrics = {key: value if key.endswith(EXTREMA) else value / max(updates, 1) for key, value in sums.items()}
        metrics["optim/updates"] = updates
        metrics.update(self.algorithm.summarize(metrics, updates))
        return metrics
