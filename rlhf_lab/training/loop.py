"""The one training loop for every on-policy algorithm: build the parts, then steps, evaluation, checkpoints.

A step: sample prompts -> experience (generate, score, reference, KL terms) -> the algorithm's advantages ->
the updater's epochs -> KL controller -> records. Every swappable part is looked up in the registry by its
config name; this file never asks which algorithm, estimator, placement or reward it runs.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

import rlhf_lab.components  # noqa: F401  (registers the built-in parts)
from rlhf_lab.data.prompts import PromptSplits, check_model_prompts, load_prompts
from rlhf_lab.errors import TrainingStopped as TrainingStopped  # where the loop's callers look for it
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.masked import masked_sum
from rlhf_lab.models.loading import DTYPES, build_policy, enable_activation_checkpointing, load_tokenizer
from rlhf_lab.models.offload import HostWeights
from rlhf_lab.registry import get
from rlhf_lab.rewards.base import build_reward
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import progress_bar, say
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.step.ahead import continuous_source, refill_source, staleness, step_batch
from rlhf_lab.step.compute import gradient_checkpointing
from rlhf_lab.step.experience import Experience, ExperienceMaker
from rlhf_lab.step.step_metrics import StepSignals
from rlhf_lab.step.update import Updater
from rlhf_lab.testbed.metrics import exact_step_metrics
from rlhf_lab.trackers.multi import build_tracker
from rlhf_lab.training.budget import TrainingClock
from rlhf_lab.training.evaluation import Evaluation
from rlhf_lab.training.memory_check import check_memory
from rlhf_lab.training.perf import StepPerformance
from rlhf_lab.training.records import Records, StepTimer, run_summary, synchronize
from rlhf_lab.training.run_eval import Evaluates
from rlhf_lab.training.run_state import RunState
from rlhf_lab.training.save_policy import check_disk, checkpoint_size, resolve_save
from rlhf_lab.training.setup import configure_process, resolve_device, seed_everything
from rlhf_lab.training.step_record import StepRecord
from rlhf_lab.training.stop import StopSignals


class Trainer(RunState, StopSignals, Evaluates, StepRecord):
    """Builds a run's parts from its config and trains; ``experience``, ``updater`` and ``records`` are its units."""

    updater_class: type[Updater] = Updater  # the offline stages' own takes packed rows too
    plans_steps = True  # the memory check plans this trainer's step (rlhf_lab/planner/) where memory is close
    scores_prompts = True  # the reward scores the data's prompts: their rows are checked before the model loads

    @classmethod
    def memory_options(cls, cfg: Any, precision: Precision, strategy: str, processes: int) -> dict[str, Any]:
        """:func:`check_memory`'s options for this trainer's run of ``processes`` ranks: at its start, and for each job
        of a sweep before the first starts (:mod:`rlhf_lab.training.sweep_memory`)."""
        return {"shards": processes if strategy == "fsdp" else 1, "precision": precision if cls.plans_steps else None,
                "processes": processes}

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.strategy = distributed.resolve_strategy(cfg.trainer.strategy)
        self.device = resolve_device(cfg.trainer.device)
        distributed.setup(self.strategy, self.device, cfg.trainer.collective_timeout_s)
        self.hardware = HardwareProfile.from_config(cfg.get("hardware"), self.device)
        if self.hardware.name != "default" and not self.hardware.tunes() and distributed.is_main_process():
            say(f"hardware={self.hardware.name} tunes CPU runs; on {self.device.type} the plain path runs", __name__)
        # Threads first: auto measures the CPU's products with the run's threads.
        configure_process(cfg.trainer, self.hardware)
        self.precision = Precision.from_config(cfg.trainer, self.device, warn=distributed.is_main_process(),
                                               agree=distributed.all_reduce_flags)  # auto: one answer for all ranks
        self.run_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.seed)  # the same on every rank: the same initial model
        self.prepare_resume()

        self.prompts = self.load_prompts()
        # The reward reads the data's rows before any model loads: a row it cannot score is one line now, not after
        # minutes of loading (a math answer math-verify cannot parse, a route with no reward).
        self.reward = build_reward(cfg.reward, device=str(self.device))
        if self.scores_prompts:
            self.reward.check_prompts([*self.prompts.train, *self.prompts.eval])
        self.tokenizer = load_tokenizer(cfg.model)
        check_memory(cfg, self.tokenizer, DTYPES[self.precision.weights_dtype], self.precision.compute_dtype,
                     self.device, **self.memory_options(cfg, self.precision, self.strategy, distributed.world_size()))
        fsdp = self.strategy == "fsdp"
        # Under FSDP only rank 0 reads the weights; the other ranks build on the meta device and receive their
        # shards from it (below). The reference is made in the compute dtype (under FSDP every weight), never as a
        # second float32 copy.
        broadcasts = fsdp and distributed.world_size() > 1
        receives = broadcasts and not distributed.is_main_process()
        self.models = build_policy(cfg.model, self.tokenizer, self.precision.weights_dtype, cfg.seed,
                                   reference_dtype=self.precision.compute_dtype, every_reference_weight=fsdp,
                                   meta=receives)
        check_model_prompts(self.prompts, self.tokenizer, self.models.policy, cfg)
        if gradient_checkpointing(cfg.trainer, self.device):  # null: on under CUDA
            enable_activation_checkpointing(self.models.policy)
        # Under FSDP the policy stays on the CPU until it is sharded (below): each block moves its shard only.
        policy = self.models.policy if fsdp else self.models.policy.to(self.device)
        whole_states = {"policy": policy.state_dict()} if broadcasts and not receives else {}  # rank 0's, to broadcast
        if self.models.reference is not None and whole_states:
            whole_states["reference"] = self.models.reference.state_dict()
        self.place_reference(fsdp)

        self.algorithm = get("algorithm", cfg.algorithm.name)(cfg.algorithm)
        # kl.loss_scale=advantage reads the factor the advantages gave each sample (Rollout.kl_loss_scale).
        self.algorithm.scales_kl = cfg.kl.get("loss_scale", "none") == "advantage"
        self.algorithm.setup(policy)
        for name, module in self.algorithm.modules().items():
            if whole_states:
                whole_states[name] = module.state_dict()
            if not distributed.on_meta(module):  # else it receives its shards from rank 0 (below)
                module.to(self.device)
        self.save_policy = resolve_save(cfg.trainer)  # all | model | none (rlhf_lab/training/save_policy.py)
        if distributed.is_main_process():  # the whole weights, before they are sharded
            check_disk(cfg.trainer, checkpoint_size(cfg.trainer, policy, self.algorithm.modules(),
                                                    self.models.uses_adapter, self.save_policy), self.run_dir)
        # Under ddp/fsdp the policy and the algorithm's own modules train wrapped; generation uses the module.
        compute_dtype = self.precision.compute_dtype
        self.policy = distributed.wrap(policy, self.strategy, self.device, compute_dtype)
        sync_modules = [self.policy]

        def wrap(module: torch.nn.Module) -> torch.nn.Module:
            sync_modules.append(distributed.wrap(module, self.strategy, self.device, compute_dtype))
            return sync_modules[-1]

        self.algorithm.wrap_modules(wrap)
        if broadcasts:  # rank 0's weights, broadcast into every rank's shards
            sharded = {"policy": policy, "reference": self.models.reference, **self.algorithm.modules()}
            for name, module in sharded.items():
                if module is not None:
                    distributed.load_from_rank0(module, whole_states.get(name), self.device)
            whole_states.clear()
        if distributed.world_size() > 1:  # every rank samples its own noise from here on
            seed_everything(cfg.seed + 1_000_003 * distributed.rank())
        self.kl = KLPenalty(cfg.kl)  # the estimator, placed in the reward or the loss (rlhf_lab/kl/placements.py)
        self.kl_controller = get("kl_controller", cfg.kl.controller)(
            coef=cfg.kl.coef, target=cfg.kl.target, horizon=cfg.kl.horizon
        )
        self.experience = ExperienceMaker(cfg, self.tokenizer, self.models, distributed.unwrap(self.policy),
                                          self.reward, self.kl, self.device, self.precision,
                                          keep_hidden=self.algorithm.reads_sampling_hidden, hardware=self.hardware,
                                          sync_probe=self.prompts.train[0] if self.prompts.train else None)
        # The engine's lifecycle and the batches sampled ahead (generation.max_staleness=k): generation/worker.py
        self.worker, self.staleness = self.experience.worker, staleness(cfg)
        if self.worker.continuous is not None:  # generation.continuous: its engine launches the data's prompts in order
            self.worker.continuous.source = continuous_source(cfg, self.prompts.train)
        self.next_launch = 1  # the first step whose batch is not yet launched (step 0 samples when it comes)
        self.updater = self.updater_class(cfg, self.policy, self.algorithm, self.loss_kl(), self.device,
                                          self.precision, self.strategy, sync_modules, self.hardware)
        self.start_step = 0
        self.step = -1
        self.first_eval: dict[str, Any] | None = None
        self.stop_requested: str | None = None
        self.stop_signal: int | None = None
        self._eval_examples: list[tuple[str, str, float]] = []
        self.signals = StepSignals(cfg, self.tokenizer.eos_token_id, self.precision.name)  # lengths, spread, floor
        self.evaluation: Evaluation | None = None  # built at the first evaluation
        self.clock = TrainingClock(cfg.trainer.max_train_seconds)  # checkpointed: a resume continues it
        self.performance = StepPerformance(cfg, self.tokenizer, self.precision, self.device)  # perf/* metrics

        resolved = OmegaConf.to_container(cfg, resolve=True)
        tracker = build_tracker(cfg.logger, resolved, self.run_dir, resuming=self.resume_from is not None)
        self._maybe_resume()
        self.records = Records(self.run_dir, tracker, cfg.logger.samples_every)

    def place_reference(self, fsdp: bool) -> None:
        """The frozen reference where its passes run: sharded like the policy under FSDP (never a whole copy per
        rank; its shards in host memory with ``trainer.offload_reference``), else on the CPU between passes with
        ``trainer.offload_reference`` or on the device. Under a mixed
        precision its matrices are kept in the compute dtype (LoRA's base weights: the reference is the policy)."""
        reference, offload = self.models.reference, self.cfg.trainer.offload_reference
        if reference is not None and fsdp:  # its shards in host memory with trainer.offload_reference
            distributed.shard(reference, self.precision.compute_dtype, offload=offload)
        elif reference is not None and not offload:
            reference.to(self.device)
        if not fsdp:  # under FSDP its MixedPrecisionPolicy gathers the weights in the compute dtype
            self.precision.store_frozen_weights(self.models.reference_model())
        if reference is not None and offload and not fsdp:  # pinned host memory, copied in for each pass
            self.models.host_weights = HostWeights(reference, self.device)

    def load_prompts(self) -> PromptSplits:
        """The train and held-out prompts (the offline stages read them from their examples)."""
        return load_prompts(self.cfg.data, seed=self.cfg.seed)

    # ----------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, Any]:
        """One step on fresh samples: sample, score, advantages, update, record. Returns its metrics (written by
        the caller, :meth:`train`)."""
        cfg, coef, timer = self.cfg, self.kl_controller.coef, self.performance.timer()
        self.step, self.worker.timer = step, timer  # the step being trained; the engine's loads are its phases
        self.worker.step = step
        synchronize()
        self.performance.step_started()  # perf/peak_memory_gib: this step's peak on a GPU
        start = time.perf_counter()
        batch = step_batch(cfg, self.prompts.train, step)
        experience = self.experience.make(  # sample and score; under generation.max_staleness=1 the next batch
            batch.prompts, cfg.algorithm.group_size, timer, batch.names, coef, rng_keys=batch.keys, train=True,
            refill=refill_source(cfg, self.prompts.train, step), then=lambda: self.launch_ahead(step, timer))
        sampled_mask = experience.rollout.response_mask  # every sample drawn, before dropped ones leave the loss
        # The training batch made from the scored one (both frozen): the algorithm's advantages, dropped samples out.
        with timer.phase("advantages"), self.precision.autocast():  # a separate critic's trunk runs here
            training, advantage_stats = self.algorithm.training_batch(
                experience.rollout.for_training(), self.updater.forward, experience.in_loss,
                keep_ref_logits=self.experience.update_needs_ref_logits)
        experience = dataclasses.replace(experience, rollout=training)
        update_stats, kl_per_sequence = self.update_policy(experience, sampled_mask, coef, step, timer)
        if self.updater.pass_entropy is not None:  # measured by the training pass: the step records it
            experience = dataclasses.replace(experience, rollout=dataclasses.replace(
                training, entropy=self.updater.pass_entropy))
        synchronize()
        return self.record_step(step, experience, sampled_mask, coef, kl_per_sequence, time.perf_counter() - start,
                                timer, {**advantage_stats, **update_stats})

    def update_policy(self, experience: Experience, sampled_mask: torch.Tensor, coef: float, step: int,
                      timer: StepTimer) -> tuple[dict[str, Any], torch.Tensor]:
        """The updater's epochs on the step's batch, then the KL controller and the schedule; returns the update's
        metrics and the batch's KL per sequence over every sampled token (every rank's)."""
        rollout = experience.rollout  # the training batch: dropped samples' tokens count nowhere from here on
        stats = self.updater.update(rollout, coef, step, timer)
        self.worker.weights_updated()  # the engine takes them before it next samples
        # The controller follows the exact KL per sequence where it is computed (kl.exact=step), else the estimate.
        measured = rollout.kl_exact if rollout.kl_exact is not None else rollout.kl_estimate
        kl_per_sequence = distributed.gather_rows(masked_sum(measured, sampled_mask, dim=-1))
        self.kl_controller.update(float(kl_per_sequence.mean()), len(kl_per_sequence))
        self.updater.scheduler.step()
        return stats, kl_per_sequence

    def launch_ahead(self, step: int, timer: StepTimer) -> None:
        """Under ``generation.max_staleness=k``, once step ``step``'s samples are in: the batches of the steps up to
        ``step + k`` not yet started, with the current weights (only steps the run will train)."""
        last = min(step + self.staleness, self.cfg.trainer.steps - 1)
        while self.staleness and self.next_launch <= last:
            batch = step_batch(self.cfg, self.prompts.train, self.next_launch)
            with timer.phase("generate"):
                self.experience.generate_ahead(batch.prompts, self.cfg.algorithm.group_size, batch.keys)
            self.next_launch += 1

    def loss_kl(self) -> KLPenalty | None:
        """The KL penalty whose loss-placed term the updater adds (the offline stages: none)."""
        return self.kl

    # ----------------------------------------------------------------- the loop's hooks (OfflineTrainer overrides)
    def step_extras(self, step: int) -> dict[str, Any]:
        """The exact task's metrics by enumeration (model=exact, rlhf_lab/testbed/); {} otherwise."""
        return exact_step_metrics(self, step)

    def progress_postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        kl = metrics.get("kl/exact", metrics["kl/estimate"])
        return {"reward": f"{metrics['reward/mean']:.3f}", "kl": f"{kl:.4f}"}

    def summarize(self, history: list[dict[str, Any]], done: int, final_eval: dict[str, Any]) -> dict[str, Any]:
        """``summary.json`` once the steps are done (before the clock's and the precision's entries)."""
        return run_summary(self.records.history() or history, done, self.run_dir, self.updater.skipped_updates,
                           self.first_eval, final_eval)

    def write_outputs(self) -> None:
        """What a run writes after its final checkpoint (the offline stages: ``RUN/model``); nothing here."""

    def train(self) -> dict[str, Any]:
        """Steps, evaluation before and after, checkpoints, signals, the time budget: every trainer's loop, under
        the run's hardware profile."""
        with self.hardware.running():
            return self._train()

    def close(self) -> None:
        """At the end of a run, however it ended: the engine's files and logging (``generation/``), the records."""
        getattr(self.worker.engine, "close", lambda: None)()
        self.records.close()

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        steps = cfg.trainer.steps
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._handle_signal)
        history: list[dict[str, Any]] = []
        self.clock.start_segment()
        last = self.start_step if self.clock.reached(self.device) else steps  # a resume past its budget: no step
        progress = progress_bar(range(self.start_step, last), cfg.trainer.progress_bar, self.start_step, steps)
        try:
            if self.start_step == 0 and cfg.trainer.eval_prompts > 0:
                self.first_eval = self.evaluate(0)  # saved with checkpoints: a resumed run's summary keeps it
                if self.first_eval:
                    self.records.log({"step": 0, **self.first_eval}, 0)
                self._print_example("before training")
            step = self.start_step - 1
            for step in progress:
                # Step s starts from s updates: its line holds the evaluation of that policy, if one is due.
                evaluated = self.evaluate(step) if self.evaluation_due(step) else {}
                with self.clock.timing():
                    metrics = self.train_step(step)
                out_of_time = self.clock.reached(self.device)  # trainer.max_train_seconds: this step is the last
                metrics.update(self.step_extras(step))
                metrics.update(evaluated)
                last_step = out_of_time or step + 1 == steps
                self.records.log(metrics, step)
                history.append(metrics)
                if hasattr(progress, "set_postfix"):
                    progress.set_postfix(**self.progress_postfix(metrics))
                every = cfg.trainer.checkpoint_every
                stop = self.agree_on_stop()  # the same answer on every rank, whichever rank got the signal
                if stop:
                    self.save(step + 1, full=True)
                    raise self._stopped(step)
                periodic = every > 0 and (step + 1) % every == 0 and self.save_policy != "none"
                if periodic and not last_step:  # the last one is written after the final evaluation
                    self.save(step + 1)
                if out_of_time:
                    self.clock.announce(step)
                    break
            done = step + 1  # steps trained, over every segment
            # The final save comes after it: the evaluation must leave the generators as the next step (a resumed
            # or longer run's) would find them.
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                final_eval = self.evaluate(done) if cfg.trainer.eval_prompts > 0 else {}
            if final_eval:
                self.records.log({"step": done, **final_eval}, done)
                self._print_example("after training")
            summary = self.summarize(history, done, final_eval)
            summary.update(self.clock.summary(done, steps))  # stopped_by: steps | max_train_seconds
            summary["precision"] = self.precision.name  # what trainer.precision (auto by default) resolved to
            summary["save"] = self.save_policy
            # The final evaluation and summary.json first: a save that fails (a full disk) loses no result.
            self.records.write_summary(summary)
            if self.save_policy != "none" and done > self.start_step:
                self.save(done, export=True)
            self.write_outputs()
            self.records.finish(summary)
            return summary
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.close()
