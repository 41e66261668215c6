"""The loop of the offline stages that train a causal LM (``algorithm=sft|dpo``): the online trainer, fed
from data.

It is :class:`rlhf_lab.training.loop.Trainer` with batches read from examples instead of sampled: the same
model building (LoRA; the reference as the adapter-disabled policy), updater (AdamW, schedule, micro-batches,
non-finite guards; no loss-placed KL term), trackers, checkpoints with exact resume, signals, and the same
yardstick: :meth:`Trainer.evaluate` generates on the held-out prompts, scores them with ``reward=`` and logs
``eval/reward/mean``, ``eval/kl/exact`` against the reference and the response length, so offline and online
runs sit in one report. The stage adds its own held-out metrics (``eval/loss``, ``eval/rewards/…``).

At the end the trained model is written to ``RUN/model`` (``save_pretrained`` with its tokenizer; under
LoRA merged into full weights, or the adapter with ``algorithm.export=adapter``), loadable as
``model=path model.name_or_path=RUN/model``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlhf_lab.algorithms.base import PolicyOutput
from rlhf_lab.data.prompts import PromptSplits, prompt_indices
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.offline.batch import Collator
from rlhf_lab.offline.data import ExampleSplits, load_examples
from rlhf_lab.offline.packing import PackedRows, packed_logits
from rlhf_lab.offline.stage import to_device
from rlhf_lab.registry import get
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.timer import StepTimer, synchronize
from rlhf_lab.scoring.logprobs import gather_logprobs
from rlhf_lab.step.update import Updater
from rlhf_lab.trackers.jsonl import read_jsonl
from rlhf_lab.training.loop import Trainer
from rlhf_lab.training.records import run_summary

MODEL_FOLDER = "model"  # the stage's output inside the run folder


def load_stage_examples(cfg: Any, pairs: bool) -> ExampleSplits:
    """The run's examples; ``data=embedded_preferences`` builds (once, cached) its pairs first."""
    data_cfg = cfg.data
    if data_cfg.name == "embedded_preferences":
        from rlhf_lab.offline.builder import ensure_preferences

        data_cfg = ensure_preferences(cfg)
    return load_examples(data_cfg, seed=cfg.seed, pairs=pairs)


def offline_summary(history: list[dict[str, Any]], steps: int, run_dir: Path, skipped: int,
                    first_eval: dict[str, Any] | None, final_eval: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` of an offline stage: loss over the first and last 20% of steps, timing, evaluations."""
    summary = run_summary(history, steps, run_dir, skipped, first_eval, final_eval, curve=("loss/total", "loss"))
    return {"model_dir": str(run_dir / MODEL_FOLDER), **summary}


class OfflineUpdater(Updater):
    """The updater of the offline stages: packed rows (``algorithm.packing``) take their block-diagonal forward
    pass (:mod:`rlhf_lab.offline.packing`), other batches the usual one."""

    @staticmethod
    def temperature(cfg: Any) -> float:
        """1: SFT, DPO and reward-model losses are the model's own distribution (as TRL's); ``trainer.temperature``
        is only the evaluation's sampling temperature."""
        return 1.0

    def forward(self, batch: Rollout) -> PolicyOutput:
        if not isinstance(batch, PackedRows):
            return super().forward(batch)
        with self.precision.autocast():
            logits = packed_logits(self.policy, batch, 1.0)
        logprobs = gather_logprobs(logits, batch.response_ids) * batch.response_mask
        return PolicyOutput(logprobs=logprobs, logits=logits, hidden=None)


class OfflineTrainer(Trainer):
    """Runs an offline stage (the registered ``algorithm``) over batches of ``trainer.prompts_per_step``
    examples, drawn in an order that is a pure function of (seed, step), so a resumed run sees the same."""

    updater_class = OfflineUpdater  # takes packed rows (algorithm=sft algorithm.packing=true) too
    plans_steps = False  # the planner plans on-policy steps; an offline stage is checked by its estimate
    scores_prompts = False  # its prompts come with their examples; the reward scores only what it evaluates

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.collator = Collator(self.tokenizer, cfg.model, cfg.data)

    def loss_kl(self) -> None:
        """The stage's loss is the whole objective: no loss-placed KL term (the KL is only measured)."""
        return None

    def load_prompts(self) -> PromptSplits:
        pairs = get("algorithm", self.cfg.algorithm.name).pairs
        self.examples = load_stage_examples(self.cfg, pairs)
        return PromptSplits(train=self.examples.train_prompts(), eval=self.examples.held_out_prompts())

    # ----------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        self.step = step
        timer = StepTimer()
        synchronize()
        start = time.perf_counter()
        indices = prompt_indices(step, cfg.trainer.prompts_per_step, len(self.examples.train), cfg.seed)
        with timer.phase("collate"):
            batch = to_device(self.algorithm.collate(self.collator, [self.examples.train[i] for i in indices]),
                              self.device)
        with timer.phase("reference"):
            batch = self.algorithm.prepare(batch, self)
        update_stats = self.updater.update(batch, 0.0, step, timer)
        self.updater.scheduler.step()
        synchronize()
        elapsed = time.perf_counter() - start
        metrics: dict[str, Any] = {
            "step": step,
            **update_stats,
            "response/length_mean": batch.response_mask.sum(-1).mean().item(),
            "lr": self.updater.scheduler.get_last_lr()[0],
            "optim/grad_norm": self.updater.last_grad_norm,
            "time/step_s": elapsed,
            "throughput/tokens_per_s": float(batch.attention_mask.sum()) / elapsed,
            **self.algorithm.batch_metrics(batch),
        }
        metrics.update({f"time/{name}_s": seconds for name, seconds in timer.times.items()})
        if self.updater.consecutive_skips >= cfg.trainer.max_consecutive_skips:
            self.stop_requested = (
                f"{self.updater.consecutive_skips} consecutive updates were skipped for non-finite loss or gradient"
            )
        return metrics

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, step: int) -> dict[str, Any]:
        """The yardstick of every run (generation on held-out prompts, reward, exact KL, length), then the
        stage's own held-out metrics."""
        metrics = super().evaluate(step)
        was_training = self.policy.training
        self.policy.eval()
        metrics.update(self.algorithm.held_out_metrics(self, self.examples.eval))
        self.policy.train(was_training)
        return metrics

    # ----------------------------------------------------------------- output
    def export(self) -> Path:
        """Write the trained model and tokenizer to ``RUN/model`` (merged under LoRA unless export=adapter)."""
        folder = self.run_dir / MODEL_FOLDER
        model = distributed.unwrap(self.policy)
        if self.models.uses_adapter and self.cfg.algorithm.export == "merged":
            model = model.merge_and_unload()
        model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        return folder

    def history(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [r for r in read_jsonl(path) if "loss/total" in r] if path.is_file() else []

    # ----------------------------------------------------------------- the loop's hooks
    def step_extras(self, step: int) -> dict[str, Any]:
        return {}

    def progress_postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        return {"loss": f"{metrics['loss/total']:.4f}"}

    def write_outputs(self) -> None:
        """Export the trained model (``RUN/model``) after the final checkpoint: merging a LoRA adapter unloads it."""
        if distributed.is_main_process():
            self.export()

    def summarize(self, history: list[dict[str, Any]], done: int, final_eval: dict[str, Any]) -> dict[str, Any]:
        """The summary over the loss curve (``model_dir``: where :meth:`write_outputs` exports the model)."""
        return offline_summary(self.history() or history, done, self.run_dir, self.updater.skipped_updates,
                               self.first_eval, final_eval)
