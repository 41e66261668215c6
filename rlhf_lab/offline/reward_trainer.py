"""The loop of ``algorithm=reward_model``: the offline loop with a sequence classifier in place of the policy.

It keeps what every run shares (run folder checks, the updater's AdamW, schedule, gradient clipping and
non-finite skips, trackers, checkpoints with exact resume, signals, ``summary.json``) and swaps the model and
the evaluation: held-out ``eval/accuracy``, ``eval/margin_mean`` and ``eval/loss`` over the eval pairs (a
reward model generates nothing, so it has no generation yardstick). ``RUN/model`` holds the final model
(LoRA merged) with its tokenizer: ``reward=reward_model reward.model_path=RUN/model`` loads it as it is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_lab.data.prompts import PromptSplits, prompt_indices
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.models.loading import DTYPES, load_tokenizer
from rlhf_lab.offline.loop import MODEL_FOLDER, OfflineTrainer
from rlhf_lab.offline.reward_model import build_reward_model, pair_metrics
from rlhf_lab.offline.stage import chunks
from rlhf_lab.registry import get
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.step.update import Updater
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training.budget import TrainingClock
from rlhf_lab.training.memory_check import check_memory
from rlhf_lab.training.records import Records
from rlhf_lab.training.save_policy import check_disk, checkpoint_size, resolve_save
from rlhf_lab.training.setup import configure_process, resolve_device, seed_everything


class RewardModelTrainer(OfflineTrainer):
    @classmethod
    def memory_options(cls, cfg: Any, precision: Precision, strategy: str, processes: int) -> dict[str, Any]:
        """A scalar head (one logit per token) over the pairs of one pass, and no reference."""
        micro = cfg.trainer.micro_batch_size
        pairs = max(micro // 2, 1) if micro else cfg.trainer.prompts_per_step  # per pass, as train_step splits
        return {"rows": 2 * pairs, "logits_width": 1, "reference": False}

    def __init__(self, cfg: Any, run_dir: Path) -> None:  # super().__init__ would build a policy: not here
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.device = resolve_device(cfg.trainer.device)
        self.hardware = HardwareProfile.from_config(cfg.get("hardware"), self.device)
        configure_process(cfg.trainer, self.hardware)  # before auto measures the CPU's products
        self.precision = Precision.from_config(cfg.trainer, self.device, warn=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.seed)
        self.prepare_resume()  # as every run: verified digests, the changes a resume may make
        self.prompts = self.load_prompts()
        self.tokenizer = load_tokenizer(cfg.model)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # the end of the response matters more than a long prompt's start
        self.algorithm = get("algorithm", cfg.algorithm.name)(cfg.algorithm)
        check_memory(cfg, self.tokenizer, DTYPES[self.precision.weights_dtype], self.precision.compute_dtype,
                     self.device, **self.memory_options(cfg, self.precision, "single", 1))
        self.model = build_reward_model(cfg.model, self.tokenizer, DTYPES[self.precision.weights_dtype], cfg.seed)
        self.model.to(self.device)
        self.model.config.pooling = cfg.algorithm.pooling  # read back by reward=reward_model when it scores
        self.save_policy = resolve_save(cfg.trainer)
        check_disk(cfg.trainer, checkpoint_size(cfg.trainer, self.model, {}, cfg.model.lora.enabled, self.save_policy),
                   self.run_dir)
        self.policy = self.model
        self.updater = Updater(cfg, self.model, self.algorithm, None, self.device, self.precision, "single",
                               [self.model], self.hardware)
        self.start_step, self.step = 0, -1
        self.first_eval: dict[str, Any] | None = None
        self.stop_requested: str | None = None
        self.stop_signal: int | None = None
        self._eval_examples: list[tuple[str, str, float]] = []
        self.clock = TrainingClock(cfg.trainer.max_train_seconds)
        tracker = get("logger", cfg.logger.name)(cfg.logger, OmegaConf.to_container(cfg, resolve=True), self.run_dir)
        self._maybe_resume()
        self.records = Records(self.run_dir, tracker, cfg.logger.samples_every)

    def load_prompts(self) -> PromptSplits:
        splits = super().load_prompts()
        if not self.examples.eval:
            print("reward_model: no held-out pairs (data.eval_fraction=0 and no eval split): no eval accuracy")
        return splits

    # ----------------------------------------------------------------- checkpoints
    def _maybe_resume(self) -> None:
        if self.resume_from is not None:
            self.continue_from(self.restore_checkpoint(self.model, {}, self.cfg.model.lora.enabled))

    def save(self, step: int, full: bool = False, export: bool = False) -> Path | None:
        """``step_{step}``: the reward model (one process: its whole weights, ``export`` or not)."""
        state = {**self.updater.state_dict(), "first_eval": self.first_eval, **self.clock.state_dict(),
                 "precision": self.precision.name}
        return ckpt.save_checkpoint(self.checkpoint_root, step, self.model, self.tokenizer, {}, self.updater.optimizer,
                                    self.updater.scheduler, state, keep_last_n=self.cfg.trainer.keep_last_n,
                                    config=OmegaConf.to_container(self.cfg, resolve=True),
                                    with_optimizer=full or self.save_policy == "all")

    def close(self) -> None:
        """At the end of a run: the records (no generation engine here)."""
        self.records.close()

    # ----------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, Any]:
        cfg, updater = self.cfg, self.updater
        self.step = step
        timer = StepTimer()
        start = time.perf_counter()
        indices = prompt_indices(step, cfg.trainer.prompts_per_step, len(self.examples.train), cfg.seed)
        examples = [self.examples.train[i] for i in indices]
        per_micro = max(cfg.trainer.micro_batch_size // 2, 1) if cfg.trainer.micro_batch_size else len(examples)
        self.model.train()
        updater.optimizer.zero_grad(set_to_none=True)
        loss_sum, finite = 0.0, True
        chosen_all, rejected_all = [], []
        with timer.phase("forward_backward"):
            for part in chunks(examples, per_micro):
                with self.precision.autocast():
                    chosen, rejected = self.algorithm.rewards(self.model, self.tokenizer, part, self.device)
                loss = self.algorithm.pair_loss(chosen, rejected, part).sum() / len(examples)
                finite = finite and bool(torch.isfinite(loss.detach()))
                updater.backward(loss)
                loss_sum += float(loss.detach())
                chosen_all.append(chosen.detach())
                rejected_all.append(rejected.detach())
        with timer.phase("optimizer"):
            applied = updater.optimizer_step(finite)
        updater.scheduler.step()
        elapsed = time.perf_counter() - start
        stats = pair_metrics(torch.cat(chosen_all), torch.cat(rejected_all))
        metrics: dict[str, Any] = {
            "step": step, "loss/total": loss_sum, "loss/bradley_terry": loss_sum,
            **{f"train/{k}": v for k, v in stats.items()},
            "optim/skipped": 0.0 if applied else 1.0, "lr": updater.scheduler.get_last_lr()[0],
            "optim/grad_norm": updater.last_grad_norm, "time/step_s": elapsed,
            **{f"time/{name}_s": seconds for name, seconds in timer.times.items()},
        }
        if updater.consecutive_skips >= cfg.trainer.max_consecutive_skips:
            self.stop_requested = f"{updater.consecutive_skips} consecutive updates were skipped for non-finite loss or gradient"
        return metrics

    # ----------------------------------------------------------------- evaluation and output
    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out accuracy, mean margin and Bradley–Terry loss over every eval pair."""
        examples = self.examples.eval
        if not examples:
            return {}
        self.model.eval()
        chosen_all, rejected_all, loss = [], [], 0.0
        for part in chunks(examples):
            with self.precision.autocast():
                chosen, rejected = self.algorithm.rewards(self.model, self.tokenizer, part, self.device)
            loss += float(self.algorithm.pair_loss(chosen, rejected, part).sum())
            chosen_all.append(chosen)
            rejected_all.append(rejected)
        self.model.train()
        stats = pair_metrics(torch.cat(chosen_all), torch.cat(rejected_all))
        return {"eval/loss": loss / len(examples), **{f"eval/{k}": v for k, v in stats.items()}}

    def export(self) -> Path:
        """The reward model in ``RUN/model``: merged under LoRA, so it loads as a plain sequence classifier."""
        folder = self.run_dir / MODEL_FOLDER
        model = self.model.merge_and_unload() if self.cfg.model.lora.enabled else self.model
        model.config.pooling = self.cfg.algorithm.pooling
        model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        return folder
