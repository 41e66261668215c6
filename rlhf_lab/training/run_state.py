"""A run's state across processes: the checkpoint it resumes from (verified, its config compared), and the
checkpoints it writes (the policy, the optimizer, the loop's own state and the batches in flight)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_lab.generation.continuous import CONTINUOUS_FILE, continuous_files
from rlhf_lab.generation.staleness import RING_FILE, ring_files
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say
from rlhf_lab.step.ahead import AHEAD_FILE, decode_ahead, encode_ahead
from rlhf_lab.trackers.jsonl import repair_jsonl
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training import resume_contract
from rlhf_lab.training.state_encoding import rank_rng_state, set_rank_rng_state


class RunState:
    """The :class:`~rlhf_lab.training.loop.Trainer`'s resume and checkpoints (the offline stages share them)."""

    def prepare_resume(self) -> None:
        """Before anything loads: the checkpoint to resume from (``resume_from``), its digests verified (else an
        earlier checkpoint), its config compared (``resume_changes``: what may change, and how), the precision it
        continues in; a fresh start that would mix with an earlier run's files is refused."""
        cfg, main = self.cfg, distributed.is_main_process()
        self.checkpoint_root = self.run_dir / "checkpoints"
        self.resume_from = ckpt.prepare_run_folder(cfg.trainer.resume, self.run_dir, clear_logs=main,
                                                    overwrite=bool(cfg.trainer.get("overwrite", False)))
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
        resume_contract.check_prompts(self.cfg, folder, state.get("prompts"), self.prompts.digest())
        rank_rng = state.get("rank_rng")
        if rank_rng and len(rank_rng) == distributed.world_size():  # every rank's own generators
            set_rank_rng_state(rank_rng[distributed.rank()])
        self.worker.weights_loaded(state["step"] + 1)  # the engine, built before the weights loaded, takes them next
        if self.staleness:  # the batches launched before the checkpoint: the next k steps'
            self.worker.load_state(decode_ahead(ckpt.read_tensors(folder / AHEAD_FILE), state.get("ahead")),
                                   self.device)
            self.next_launch = state["step"] + 1 + self.staleness
        if self.worker.continuous is not None and state.get("continuous"):  # its groups launched, not yet taken
            self.worker.continuous.load_state(ckpt.read_tensors(folder / CONTINUOUS_FILE), state["continuous"])
        if self.worker.ring is not None:  # generation.simulate_staleness: the last k policies' weights
            self.worker.ring.load_state(ckpt.read_tensors(folder / RING_FILE), state["step"] + 1, str(folder))
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

    def save(self, updates: int, full: bool = False, export: bool = False) -> Path | None:
        """Write the checkpoint ``step_{updates}``, the policy after ``updates`` updates, with the optimizer's state
        under ``trainer.save=all`` or when ``full`` (a stop by signal: its resume command needs it): under FSDP every
        rank writes its shards (``sharded/``, DCP) and hashes them; the whole weights are gathered (onto rank 0) only
        when ``export`` (the run's last save) for ``model/``. Rank 0 writes the rest while the other ranks wait at a
        barrier (not in a collective of the next step). Returns its folder (None on other ranks)."""
        updater, modules = self.updater, self.algorithm.modules()
        policy = distributed.unwrap(self.policy)
        with_optimizer = full or self.save_policy == "all"
        whole: dict[str, Any] = {}
        if self.strategy == "fsdp" and export:  # collectives: the whole weights, for the Hugging Face folder
            whole = {"model_state": distributed.full_model_state(policy),
                     "module_states": {name: distributed.full_model_state(m) for name, m in modules.items()}}
        if self.strategy == "fsdp" and (with_optimizer or not export):  # collectives: every rank writes its shards
            staged = ckpt.staging_folder(self.checkpoint_root, updates)
            if distributed.is_main_process():
                ckpt.prepare_staging(self.checkpoint_root, updates)
            distributed.barrier()
            ckpt.save_sharded(staged, policy, modules, updater.optimizer if with_optimizer else None)
            digests = distributed.gather_objects([ckpt.own_shard_digests(staged, distributed.rank())])
            whole.update(staged=staged, shard_digests={k: v for own in digests for k, v in own.items()})
        ahead_tensors, ahead = encode_ahead(self.worker.state()) if self.staleness else ({}, None)  # batches in flight
        engine_files, engine_state = continuous_files(self.worker.continuous)  # generation.continuous's groups
        rank_rng = distributed.gather_objects([rank_rng_state()])
        folder = None
        if distributed.is_main_process():  # one writer: rank 0
            trainer_state = {"kl_controller": self.kl_controller.state_dict(), **updater.state_dict(),
                             "first_eval": self.first_eval, **self.clock.state_dict(),
                             "precision": self.precision.name, "ahead": ahead, "prompts": self.prompts.digest(),
                             **({"continuous": engine_state} if engine_state is not None else {})}
            if distributed.world_size() > 1:
                trainer_state["rank_rng"] = rank_rng
            folder = ckpt.save_checkpoint(self.checkpoint_root, updates, policy, self.tokenizer, modules,
                                          updater.optimizer, updater.scheduler, trainer_state,
                                          keep_last_n=self.cfg.trainer.keep_last_n,
                                          config=OmegaConf.to_container(self.cfg, resolve=True),
                                          tensor_files={**({AHEAD_FILE: ahead_tensors} if ahead else {}),
                                                        **ring_files(self.worker.ring), **engine_files},
                                          with_optimizer=with_optimizer, **whole)
        distributed.barrier()
        return folder
