"""What a run records of one training step: its metrics (``reward/*``, ``kl/*``, ``time/*``, ``perf/*``, ...) and
the samples it shows, from the step's experience and the update's statistics."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lab.config.schema import LARGE_KL_COEF
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.step.experience import Experience
from rlhf_lab.step.scoring_pass import sampler_metrics
from rlhf_lab.step.step_metrics import rollout_metrics, sampling_metrics, staleness_bias, staleness_metrics
from rlhf_lab.training.records import sample_columns


class StepRecord:
    """The :class:`~rlhf_lab.training.loop.Trainer`'s record of a step."""

    def record_step(self, step: int, experience: Experience, sampled_mask: torch.Tensor, coef: float,
                    kl_per_sequence: torch.Tensor, elapsed: float, timer: StepTimer,
                    stats: dict[str, Any]) -> dict[str, Any]:
        """The step's metrics over every rank's samples (each rank holds whole prompt groups, in rank order), its
        samples logged; asks the run to stop after too many skipped updates. ``sampled_mask``: every sample drawn
        (before dropped ones left the loss)."""
        cfg, rollout, valid = self.cfg, experience.rollout, experience.valid
        metrics: dict[str, Any] = {"step": step, **rollout_metrics(rollout, valid, coef, kl_per_sequence),
                                   **sampler_metrics(rollout), **self.worker.metrics(),
                                   **staleness_metrics(rollout, self.worker.training_version),
                                   **staleness_bias(rollout, sampled_mask, self.worker.training_version,
                                                    getattr(self.worker, "dropped", None)),
                                   "lr": self.updater.scheduler.get_last_lr()[0],
                                   "optim/grad_norm": self.updater.last_grad_norm, "time/step_s": elapsed,
                                   "throughput/tokens_per_s": float(distributed.all_reduce_sum(
                                       rollout.attention_mask.sum())) / elapsed,
                                   **sampling_metrics(experience.stats, rollout.batch_size * distributed.world_size(),
                                                      self.device)}
        metrics.update(self.signals.measure(rollout, sampled_mask, valid, step, fresh=self.start_step == 0,
                                            logged=metrics))
        sampled = float(distributed.all_reduce_sum(sampled_mask.sum()))  # dropped samples were generated too
        trained = float(distributed.all_reduce_sum(rollout.attention_mask.sum())) * cfg.algorithm.get("epochs", 1)
        prompt = int(rollout.attention_mask[:, : rollout.prompt_width].sum(-1).float().mean().ceil())
        metrics.update(self.performance.metrics(elapsed, int(sampled), int(trained), prompt_tokens=max(prompt, 1),
                                                timer=timer))
        metrics.update(stats)
        metrics.setdefault("loss/policy", 0.0)
        metrics.setdefault("policy/clipfrac", 0.0)
        metrics.update({f"time/{name}_s": seconds for name, seconds in timer.times.items()})
        shown = min(cfg.trainer.samples_per_step_logged, len(experience.responses))
        self.records.log_samples([
            {"step": step, "prompt": experience.prompts[i], "response": experience.responses[i],
             "reward": float(rollout.scores[i]), **sample_columns(rollout, i)} for i in range(shown)
        ], step)
        if self.updater.consecutive_skips >= cfg.trainer.max_consecutive_skips:
            self.stop_requested = (
                f"{self.updater.consecutive_skips} consecutive updates were skipped for non-finite loss or gradient"
            )
            if cfg.kl.coef > LARGE_KL_COEF:  # the likely cause, named: the KL term overflows once the policy moves
                self.stop_requested += (f" (kl.coef={cfg.kl.coef:g} scales the KL term past what the loss's float "
                                        "holds once the policy leaves the reference: lower kl.coef)")
        return metrics
