"""A run's evaluations: held-out prompts before, during and after training (:mod:`.evaluation` does the work)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lab.rewards.base import build_reward
from rlhf_lab.runtime.console import say
from rlhf_lab.step.experience import ExperienceMaker
from rlhf_lab.training.evaluation import Evaluation


class Evaluates:
    """The :class:`~rlhf_lab.training.loop.Trainer`'s evaluation: when one is due, and the engine it samples with."""

    def evaluation_due(self, step: int) -> bool:
        """Whether step ``step`` starts with an evaluation (every ``trainer.eval_every`` updates; the one before any
        update is the first evaluation, the one after the last the final). A resumed run evaluates where an
        uninterrupted one would."""
        every = self.cfg.trainer.eval_every
        return every > 0 and step > 0 and step % every == 0

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out prompts under ``eval.*`` (rlhf_lab/training/evaluation.py, the code ``rlhf-lab eval`` runs)."""
        self.worker.settle()  # the batch in flight is in; the evaluation samples with the current weights
        self.worker.step = step
        if self.evaluation is None:
            self.evaluation = Evaluation.from_parts(self.cfg, self.experience, self._experience_maker, self.models,
                                                    lambda reward_cfg: build_reward(reward_cfg, device=str(self.device)))
        prompts = self.prompts.eval[: self.evaluation.settings.prompts]
        if not prompts:
            return {}
        metrics, self._eval_examples = self.evaluation.run(prompts, step, self.cfg.seed, self.kl_controller.coef)
        shown = self._eval_examples[: self.cfg.trainer.samples_per_step_logged]
        self.records.log_eval_samples([{"step": step, "prompt": p, "response": r, "reward": score}
                                       for p, r, score in shown], step)
        return metrics

    def _experience_maker(self, cfg: Any, policy: torch.nn.Module, worker: Any) -> ExperienceMaker:
        return ExperienceMaker(cfg, self.tokenizer, self.models, policy, self.reward, self.kl, self.device,
                               self.precision, hardware=self.hardware, worker=worker)

    def _print_example(self, when: str) -> None:
        if self._eval_examples:
            prompt, response, score = self._eval_examples[0]
            say(f"[{when}] prompt: {prompt}\n[{when}] response ({score:+.3f}): {response}", __name__)
