"""The one training loop for every on-policy algorithm: build the parts, then steps, evaluation, checkpoints.

A step: sample prompts -> experience (generate, score, reference, KL terms) -> the algorithm's advantages ->
the updater's epochs -> KL controller -> records. Every swappable part is looked up in the registry by its
config name; this file never asks which algorithm, estimator, placement or reward it runs.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

import rlhf_lab.components  # noqa: F401  (registers the built-in parts)
from rlhf_lab.data.prompts import PromptSplits, check_model_prompts, load_prompts
from rlhf_lab.errors import TrainingStopped
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.worker import RolloutWorker
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.masked import masked_sum
from rlhf_lab.models.loading import DTYPES, build_policy, enable_activation_checkpointing, load_tokenizer
from rlhf_lab.registry import get
from rlhf_lab.rewards.base import build_reward
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import progress_bar, say
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.step.ahead import AHEAD_FILE, decode_ahead, encode_ahead, refill_source, staleness, step_batch
from rlhf_lab.step.compute import gradient_checkpointing
from rlhf_lab.step.experience import ExperienceMaker
from rlhf_lab.step.scoring_pass import sampler_metrics
from rlhf_lab.step.step_metrics import StepSignals, rollout_metrics, sampling_metrics
from rlhf_lab.step.update import Updater
from rlhf_lab.testbed.metrics import exact_step_metrics
from rlhf_lab.trackers.jsonl import repair_jsonl
from rlhf_lab.trackers.multi import build_tracker
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training import resume_contract
from rlhf_lab.training.budget import TrainingClock
from rlhf_lab.training.evaluation import Evaluation
from rlhf_lab.training.memory_check import check_memory
from rlhf_lab.training.perf import StepPerformance
from rlhf_lab.training.records import Records, StepTimer, run_summary, sample_columns, synchronize
from rlhf_lab.training.save_policy import check_disk, checkpoint_size, resolve_save
from rlhf_lab.training.setup import configure_process, resolve_device, seed_everything
from rlhf_lab.training.state_encoding import rank_rng_state, set_rank_rng_state


class Trainer:
    """Builds a run's parts from its config and trains; ``experience``, ``updater`` and ``records`` are its units."""

    updater_class: type[Updater] = Updater  # the offline stages' own takes packed rows too
    plans_steps = True  # the memory check plans this trainer's step (rlhf_lab/planner/) where memory is close

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
        self.tokenizer = load_tokenizer(cfg.model)
        check_memory(cfg, self.tokenizer, DTYPES[self.precision.weights_dtype], self.precision.compute_dtype,
                     self.device, shards=distributed.world_size() if self.strategy == "fsdp" else 1,
                     precision=self.precision if self.plans_steps else None)
        self.models = build_policy(cfg.model, self.tokenizer, self.precision.weights_dtype, cfg.seed)
        check_model_prompts(self.prompts, self.tokenizer, self.models.policy, cfg)
        if gradient_checkpointing(cfg.trainer, self.device):  # null: on under CUDA
            enable_activation_checkpointing(self.models.policy)
        fsdp = self.strategy == "fsdp"
        # Under FSDP the policy stays on the CPU until it is sharded (below): each block moves its shard only.
        policy = self.models.policy if fsdp else self.models.policy.to(self.device)
        self.place_reference(fsdp)

        self.algorithm = get("algorithm", cfg.algorithm.name)(cfg.algorithm)
        # kl.loss_scale=advantage reads the factor the advantages gave each sample (Rollout.kl_loss_scale).
        self.algorithm.scales_kl = cfg.kl.get("loss_scale", "none") == "advantage"
        self.algorithm.setup(policy)
        for module in self.algorithm.modules().values():
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
        if distributed.world_size() > 1:  # every rank samples its own noise from here on
            seed_everything(cfg.seed + 1_000_003 * distributed.rank())
        self.kl = KLPenalty(cfg.kl)  # the estimator, placed in the reward or the loss (rlhf_lab/kl/placements.py)
        self.kl_controller = get("kl_controller", cfg.kl.controller)(
            coef=cfg.kl.coef, target=cfg.kl.target, horizon=cfg.kl.horizon
        )
        self.reward = build_reward(cfg.reward, device=str(self.device))
        self.experience = ExperienceMaker(cfg, self.tokenizer, self.models, distributed.unwrap(self.policy),
                                          self.reward, self.kl, self.device, self.precision,
                                          keep_hidden=self.algorithm.reads_sampling_hidden, hardware=self.hardware,
                                          sync_probe=self.prompts.train[0] if self.prompts.train else None)
        # The engine's lifecycle and the batches sampled ahead (generation.max_staleness=k): generation/worker.py
        self.worker, self.staleness = self.experience.worker, staleness(cfg)
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
        rank), on the CPU between passes with ``trainer.offload_reference``, else on the device. Under a mixed
        precision its matrices are kept in the compute dtype (LoRA's base weights: the reference is the policy)."""
        reference, offload = self.models.reference, self.cfg.trainer.offload_reference
        if reference is not None and fsdp and not offload:
            distributed.shard(reference, self.precision.compute_dtype)
        elif reference is not None:
            reference.to("cpu" if offload else self.device)
        if not fsdp:  # under FSDP its MixedPrecisionPolicy gathers the weights in the compute dtype
            self.precision.store_frozen_weights(self.models.reference_model())

    # ----------------------------------------------------------------- resume and checkpoints
    def prepare_resume(self) -> None:
        """Before anything loads: the checkpoint to resume from (``resume_from``), its digests verified (else an
        earlier checkpoint), its config compared (``resume_changes``: what may change, and how), the precision it
        continues in; a fresh start that would mix with an earlier run's files is refused."""
        cfg, main = self.cfg, distributed.is_main_process()
        self.checkpoint_root = self.run_dir / "checkpoints"
        self.resume_from = ckpt.prepare_run_folder(cfg.trainer.resume, self.run_dir, clear_logs=main)
        self.resume_from, self.resume_changes = resume_contract.prepare(cfg, self.resume_from, warn=main)
        self.precision = resume_contract.continued_precision(cfg, self.resume_from, self.precision, announce=main)

    def restore_checkpoint(self, policy: torch.nn.Module, modules: dict[str, torch.nn.Module], uses_adapter: bool,
                           kl_controller: Any = None, sharded: bool = False) -> dict[str, Any]:
        """Load ``resume_from`` into the model, modules, optimizer and schedule (and the KL controller, if the run
        has one), then honour the resume's changes (a new ``trainer.lr``, ...); returns the trainer state."""
        updater = self.updater
        fresh_base_lrs = list(updater.scheduler.base_lrs)  # this config's, before the checkpoint's replace them
        state = ckpt.load_checkpoint(self.resume_from, policy, modules, updater.optimizer, updater.scheduler,
                                     uses_adapter, sharded=sharded)
        if kl_controller is not None:
            kl_controller.load_state_dict(state["kl_controller"])
        updater.load_state_dict(state)
        resume_contract.apply_changes(self.resume_changes, self.cfg, updater, kl_controller, fresh_base_lrs)
        return state

    def _maybe_resume(self) -> None:
        folder = self.resume_from
        if folder is None:
            return
        state = self.restore_checkpoint(distributed.unwrap(self.policy), self.algorithm.modules(),
                                        self.models.uses_adapter, self.kl_controller, sharded=self.strategy == "fsdp")
        rank_rng = state.get("rank_rng")
        if rank_rng and len(rank_rng) == distributed.world_size():  # every rank's own generators
            set_rank_rng_state(rank_rng[distributed.rank()])
        self.worker.weights_loaded(state["step"] + 1)  # the engine, built before the weights loaded, takes them next
        if self.staleness:  # the batches launched before the checkpoint: the next k steps'
            self.worker.load_state(decode_ahead(ckpt.read_tensors(folder / AHEAD_FILE), state.get("ahead")),
                                   self.device)
            self.next_launch = state["step"] + 1 + self.staleness
        self.continue_from(state)

    def continue_from(self, state: dict[str, Any]) -> None:
        """The loop's own state from a restored checkpoint (first evaluation, clock, next step); the metrics and
        samples files cut back to the steps it holds."""
        self.first_eval = state.get("first_eval")
        self.clock.load_state_dict(state)
        self.start_step = state["step"] + 1
        if distributed.is_main_process():
            for name in ("metrics.jsonl", "samples.jsonl"):
                repair_jsonl(self.run_dir / name, before_step=self.start_step)
            say(f"resumed from {self.resume_from} at step {self.start_step}", __name__)

    def load_prompts(self) -> PromptSplits:
        """The train and held-out prompts (the offline stages read them from their examples)."""
        return load_prompts(self.cfg.data, seed=self.cfg.seed)

    def save(self, updates: int, full: bool = False) -> Path | None:
        """Write the checkpoint ``step_{updates}``, the policy after ``updates`` updates, with the optimizer's state
        under ``trainer.save=all`` or when ``full`` (a stop by signal: its resume command needs it): under FSDP every
        rank writes its shards (``sharded/``, DCP) and the whole weights are gathered for ``model/``; rank 0 writes
        the rest while the other ranks wait at a barrier (not in a collective of the next step). Returns its folder
        (None on other ranks)."""
        updater, modules = self.updater, self.algorithm.modules()
        policy = distributed.unwrap(self.policy)
        with_optimizer = full or self.save_policy == "all"
        whole: dict[str, Any] = {}
        if self.strategy == "fsdp" and not with_optimizer:  # collectives: the whole weights only
            whole = {"model_state": distributed.full_model_state(policy),
                     "module_states": {name: distributed.full_model_state(m) for name, m in modules.items()}}
        elif self.strategy == "fsdp":  # collectives: every rank takes part
            staged = ckpt.staging_folder(self.checkpoint_root, updates)
            if distributed.is_main_process():
                ckpt.prepare_staging(self.checkpoint_root, updates)
            distributed.barrier()
            ckpt.save_sharded(staged, policy, modules, updater.optimizer)
            whole = {"model_state": distributed.full_model_state(policy), "staged": staged,
                     "module_states": {name: distributed.full_model_state(m) for name, m in modules.items()}}
        ahead_tensors, ahead = encode_ahead(self.worker.state()) if self.staleness else ({}, None)  # batches in flight
        rank_rng = distributed.gather_objects([rank_rng_state()])
        folder = None
        if distributed.is_main_process():  # one writer: rank 0
            trainer_state = {"kl_controller": self.kl_controller.state_dict(), **updater.state_dict(),
                             "first_eval": self.first_eval, **self.clock.state_dict(),
                             "precision": self.precision.name, "ahead": ahead}
            if distributed.world_size() > 1:
                trainer_state["rank_rng"] = rank_rng
            folder = ckpt.save_checkpoint(self.checkpoint_root, updates, policy, self.tokenizer, modules,
                                          updater.optimizer, updater.scheduler, trainer_state,
                                          keep_last_n=self.cfg.trainer.keep_last_n,
                                          config=OmegaConf.to_container(self.cfg, resolve=True),
                                          tensor_files={AHEAD_FILE: ahead_tensors} if ahead else None,
                                          with_optimizer=with_optimizer, **whole)
        distributed.barrier()
        return folder

    # ----------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, Any]:
        """One step on fresh samples; returns its metrics (written by the caller, :meth:`train`)."""
        cfg = self.cfg
        self.step = step  # the step being trained (read by hooks in tests and tools)
        timer = StepTimer()
        self.worker.timer = timer  # its weight loads and canary are timed as this step's phases
        synchronize()
        start = time.perf_counter()
        batch, coef, train = step_batch(cfg, self.prompts.train, step), self.kl_controller.coef, self.prompts.train
        experience = self.experience.make(  # under generation.max_staleness=1 the next batch starts at `then`
            batch.prompts, cfg.algorithm.group_size, timer, batch.names, coef, rng_keys=batch.keys, train=True,
            refill=refill_source(cfg, train, step), then=lambda: self.launch_ahead(step, timer))
        rollout, valid, in_loss = experience.rollout, experience.valid, experience.in_loss
        mask = rollout.response_mask
        with timer.phase("advantages"), self.precision.autocast():  # a separate critic's trunk runs here
            prepare_stats = self.algorithm.prepare(rollout, self.updater.forward)
        if not bool(in_loss.all()):
            # Dropped samples (non-finite score; truncated or tied-filler ones under the sampling rules) took
            # part in the advantage statistics; from here on their tokens count nowhere: no loss, no gradient,
            # no token in any mean.
            rollout.response_mask = mask * in_loss[:, None]
            rollout.advantages = rollout.advantages * rollout.response_mask
        rollout.policy_logits = rollout.hidden = None  # no longer needed; frees [B, T, V] and [B, T, H]
        if not self.experience.update_needs_ref_logits:
            rollout.ref_logits = None
        update_stats = self.updater.update(rollout, coef, step, timer)
        self.worker.weights_updated()  # the engine takes them before it next samples
        # Batch statistics over every rank's samples (each rank holds whole prompt groups, in rank order).
        # The controller follows the exact KL per sequence where it is computed (kl.exact=step), else the estimate.
        measured = rollout.kl_exact if rollout.kl_exact is not None else rollout.kl_estimate
        kl_per_sequence = distributed.gather_rows(masked_sum(measured, mask, dim=-1))
        self.kl_controller.update(float(kl_per_sequence.mean()), len(kl_per_sequence))
        self.updater.scheduler.step()

        synchronize()
        elapsed = time.perf_counter() - start
        metrics: dict[str, Any] = {"step": step, **rollout_metrics(rollout, valid, coef, kl_per_sequence),
                                   **sampler_metrics(rollout), **self.worker.metrics(),
                                   "lr": self.updater.scheduler.get_last_lr()[0],
                                   "optim/grad_norm": self.updater.last_grad_norm, "time/step_s": elapsed,
                                   "throughput/tokens_per_s": float(distributed.all_reduce_sum(
                                       rollout.attention_mask.sum())) / elapsed,
                                   **sampling_metrics(experience.stats, rollout.batch_size * distributed.world_size(),
                                                      self.device)}
        # mask: every sample drawn (before dropped ones left the loss)
        metrics.update(self.signals.measure(rollout, mask, valid, step, fresh=self.start_step == 0, logged=metrics))
        sampled = float(distributed.all_reduce_sum(rollout.response_mask.sum()))
        trained = float(distributed.all_reduce_sum(rollout.attention_mask.sum())) * cfg.algorithm.get("epochs", 1)
        metrics.update(self.performance.metrics(elapsed, int(sampled), int(trained)))
        metrics.update(prepare_stats)
        metrics.update(update_stats)
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
        return metrics

    def launch_ahead(self, step: int, timer: StepTimer) -> None:
        """Under ``generation.max_staleness=k``, once step ``step``'s samples are in: the batches of the steps up to
        ``step + k`` not yet started, with the current weights (only steps the run will train)."""
        last = min(step + self.staleness, self.cfg.trainer.steps - 1)
        while self.staleness and self.next_launch <= last:
            batch = step_batch(self.cfg, self.prompts.train, self.next_launch)
            with timer.phase("generate"):
                self.experience.generate_ahead(batch.prompts, self.cfg.algorithm.group_size, batch.keys)
            self.next_launch += 1

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out prompts under ``eval.*`` (rlhf_lab/training/evaluation.py, the code ``rlhf-lab eval`` runs)."""
        self.worker.settle()  # the batch in flight is in; the evaluation samples with the current weights
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

    def _experience_maker(self, cfg: Any, policy: torch.nn.Module) -> ExperienceMaker:
        # The policy's own worker, shared; the reference (win rate) samples through the same engine with the adapter
        # off where it can (LoRA on vLLM), else through the hf engine over the reference: never a second engine.
        worker = self.worker if policy is self.experience.policy else self.reference_worker(cfg, policy)
        return ExperienceMaker(cfg, self.tokenizer, self.models, policy, self.reward, self.kl, self.device,
                               self.precision, hardware=self.hardware, worker=worker)

    def reference_worker(self, cfg: Any, reference: torch.nn.Module) -> Any:
        """Sampling for the reference: the run's engine with the adapter off (LoRA on vLLM), else the hf engine over
        the reference's weights (no second copy of them, no second vLLM engine)."""
        if getattr(self.worker.engine, "samples_base", False):
            return self.worker.adapter_off()
        engine = get("generation", "hf")(reference, self.tokenizer, SamplingSettings.from_config(cfg), self.precision,
                                          self.hardware)
        return RolloutWorker(engine, reference)

    def loss_kl(self) -> KLPenalty | None:
        """The KL penalty whose loss-placed term the updater adds (the offline stages: none)."""
        return self.kl

    def _print_example(self, when: str) -> None:
        if self._eval_examples:
            prompt, response, score = self._eval_examples[0]
            say(f"[{when}] prompt: {prompt}\n[{when}] response ({score:+.3f}): {response}", __name__)

    # ----------------------------------------------------------------- signals and the loop
    def _handle_signal(self, signum: int, frame: Any) -> None:
        """First SIGINT/SIGTERM: finish the step, checkpoint, stop. A second one aborts at once."""
        name = signal.Signals(signum).name
        if self.stop_signal is not None:
            raise KeyboardInterrupt(f"second {name}")
        self.stop_signal = signum
        self.stop_requested = f"received {name}"
        print(f"received {name}: finishing the current step, then writing a checkpoint "
              f"(send it again to abort without one)", file=sys.stderr, flush=True)

    def agree_on_stop(self) -> bool:
        """Whether every rank stops after this step: when any rank was asked to (a scheduler or a user may signal
        one process of a torchrun launch only), all checkpoint and stop together instead of the others waiting in
        the next step's collectives. A rank stopped by another's signal names it and exits with its status."""
        requested = self.stop_requested is not None  # read before the signal: the handler sets the signal first
        local = torch.tensor([[float(requested), float(self.stop_signal or 0)]], dtype=torch.float64)
        every_rank = distributed.gather_rows(local)  # [world_size, 2]: one collective, on every rank at this point
        signalled = every_rank[:, 1].nonzero().flatten().tolist()
        if self.stop_signal is None and signalled:
            sender = signalled[0]
            self.stop_signal = int(every_rank[sender, 1])
            self.stop_requested = f"rank {sender} received {signal.Signals(self.stop_signal).name}"
        return bool(every_rank.any())

    def _stopped(self, step: int) -> TrainingStopped:
        resume = ("trainer.resume=auto", f"trainer.output_dir={self.run_dir.resolve()}")
        message = (f"stopped after step {step}: {self.stop_requested}; checkpoint "
                   f"{self.checkpoint_root / f'step_{step + 1}'} written; continue with: {' '.join(resume)}")
        exit_code = 128 + self.stop_signal if self.stop_signal is not None else 3
        return TrainingStopped(message, exit_code=exit_code, resume_overrides=resume)

    def evaluation_due(self, step: int) -> bool:
        """Whether step ``step`` starts with an evaluation (every ``trainer.eval_every`` updates; the one before any
        update is the first evaluation, the one after the last the final). A resumed run evaluates where an
        uninterrupted one would."""
        every = self.cfg.trainer.eval_every
        return every > 0 and step > 0 and step % every == 0

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
                self.save(done)
            self.write_outputs()
            self.records.finish(summary)
            return summary
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.records.close()
