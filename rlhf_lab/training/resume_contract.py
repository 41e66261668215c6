"""The resume contract: what a resumed run may change, verified checkpoints with fallback, segment records.

A checkpoint keeps the resolved config of the run that wrote it (``config.json``). A resume compares the new
config with it, key by key:

- keys in :data:`MAY_CHANGE` are honoured: ``trainer.lr`` and ``kl.coef`` are applied to the restored
  optimizer, schedule and KL controller (:func:`apply_changes`); ``trainer.steps`` may move as long as it
  stays above the checkpoint's step; ``trainer.max_train_seconds`` may move too (the clock of the steps
  done is restored: :mod:`rlhf_lab.training.budget`); the rest (evaluation, checkpoint and logging cadence,
  the device, the strategy, memory savers, the logger) only change how the remaining steps are run or
  recorded;
- any other change (algorithm, model, LoRA, seed, data, reward, batch shape, ...) is refused at start with
  one line naming each key, its old and new value, and how to start a fresh run instead.

``trainer.precision=auto`` resolves per machine (bf16-mixed where bfloat16 products are native and fast, else
fp32); the checkpoint records what it resolved to, and a resume continues in that precision wherever it runs
(:func:`continued_precision`): ``auto`` and the recorded precision count as the same setting.

Under Hydra each segment's resolved config is kept in ``.hydra/segments/from_step_N/`` (N: the segment's
first step), and a refused resume puts back the ``.hydra/`` files Hydra had already rewritten, so the folder
records what ran.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_lab.config.overrides import flatten
from rlhf_lab.errors import CheckpointError, ConfigError
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say
from rlhf_lab.runtime.precision import Precision, check_device
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training import run_lock
from rlhf_lab.training.checkpoint_sharded import hashed_by
from rlhf_lab.training.verify import damage

# Keys a resumed run may change ("x.*": every key under x). Everything else must match the checkpoint.
MAY_CHANGE = (
    "trainer.steps",  # as long as it stays above the checkpoint's step
    "trainer.max_train_seconds",  # the budget of the whole run: raise it to continue a run it stopped
    "trainer.lr",  # applied to the optimizer's parameter groups and the schedule
    "kl.coef",  # applied to the KL controller
    "trainer.eval_every", "trainer.checkpoint_every", "trainer.keep_last_n", "trainer.save", "trainer.samples_per_step_logged",
    "trainer.progress_bar", "trainer.library_progress_bars", "trainer.exact_every", "trainer.max_consecutive_skips",
    "trainer.resume", "trainer.output_dir",
    "trainer.device", "trainer.strategy", "trainer.num_threads", "trainer.micro_batch_size",
    "trainer.gradient_checkpointing", "trainer.recompute", "trainer.offload_reference", "trainer.logprob_chunk",
    "trainer.skip_memory_check", "trainer.chunked_logprobs", "trainer.lm_head_chunk",
    "trainer.max_tokens_per_micro_batch", "trainer.pack_rows",  # how the same update is cut (equal by design)
    "logger.*", "eval.*", "experiment_name", "experiment_time", "claims", "optimized_metric", "kl_budget",
    "kl_budget_penalty",
    "hardware.*",  # how the machine computes the same steps (a CPU profile's pieces are float-rounding apart)
    "generation.*",  # the engine that samples: the state it resumes (weights, optimizer, generators) is the same
)
GROUP_KEYS = ("algorithm", "kl", "reward", "model", "data", "logger", "hardware", "generation")  # `<group>.name` is set as `<group>=X`
SEGMENTS = "segments"
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


class ResumeRefused(ConfigError):
    """A resumed run asked for a change the checkpoint cannot honour."""


def may_change(key: str) -> bool:
    return any(key == allowed or (allowed.endswith(".*") and key.startswith(allowed[:-1])) for allowed in MAY_CHANGE)


def plain_config(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg


def stored_config(folder: Path) -> dict[str, Any] | None:
    """The config a checkpoint was written with; None for a checkpoint from before configs were kept."""
    try:
        stored = json.loads((Path(folder) / ckpt.CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def _text(value: Any) -> str:
    return "null" if value is None else value if isinstance(value, str) else json.dumps(value)


def _as_override(key: str, value: Any) -> str:
    group, _, field = key.partition(".")
    if field == "name" and group in GROUP_KEYS:
        return f"{group}={_text(value)}"
    return f"{key}={_text(value)}"


def check_changes(cfg: Any, folder: Path) -> dict[str, tuple[Any, Any]]:
    """The honoured changes (key -> (old, new)) of resuming ``cfg`` from checkpoint ``folder``.

    Raises :class:`ResumeRefused` (one line) for any other change, or a ``trainer.steps`` at or below the
    checkpoint's step. Keys one side lacks (a field added by a newer version) are not compared.
    """
    state = ckpt.read_state(folder) or {}
    step = state.get("step")
    steps = cfg.trainer.steps
    if isinstance(step, int) and steps <= step:
        raise ResumeRefused(
            f"trainer.steps={steps} is not above the step of checkpoint {folder} (steps 0..{step} are done); "
            f"continue with trainer.steps>={step + 1}, or start a fresh run in another trainer.output_dir"
        )
    stored = stored_config(folder)
    if stored is None:
        return {}
    old, new = flatten(stored), flatten(plain_config(cfg))
    changed = {key: (old[key], new[key]) for key in new if key in old and old[key] != new[key]}
    if "trainer.precision" in changed and set(changed["trainer.precision"]) == {"auto", state.get("precision")}:
        del changed["trainer.precision"]  # auto continues in the precision the checkpoint's run resolved it to
    refused = {key: values for key, values in changed.items() if not may_change(key)}
    if refused:
        chosen = {key[: -len(".name")] for key in refused if key.endswith(".name") and key.count(".") == 1}
        refused = {key: v for key, v in refused.items()  # a group's other keys follow from its option
                   if key.endswith(".name") or key.split(".", 1)[0] not in chosen}
        listed = ", ".join(f"{key}: {_text(a)} -> {_text(b)}" for key, (a, b) in refused.items())
        keep = " ".join(_as_override(key, a) for key, (a, _) in refused.items())
        raise ResumeRefused(
            f"resuming from {folder} cannot change {listed} (only trainer.steps, trainer.lr, kl.coef and cadence, "
            f"device and logging keys may change on resume); resume with {keep}, or start a fresh run with "
            "the new values: another trainer.output_dir, without trainer.resume"
        )
    return changed


def check_prompts(cfg: Any, folder: Path, stored: str | None, current: str) -> None:
    """One line where the prompts this run read are not those the checkpoint's run trained on (its data file edited
    since: the config is the same, the rows are not); nothing for a checkpoint that recorded none."""
    if stored is None or stored == current:
        return
    data = cfg.data
    source = f"data.path={data.path}" if data.get("path") else f"data={data.name}"
    raise ConfigError(f"the prompts of {source} are not those {folder} was trained on (sha256 {stored[:12]} there, "
                      f"{current[:12]} here): the data was edited since; put it back to resume, or start a fresh run "
                      "in a new folder")


def continued_precision(cfg: Any, folder: Path | None, precision: Precision, announce: bool = True) -> Precision:
    """The precision a run resumed from checkpoint ``folder`` continues in.

    ``precision`` is what ``cfg`` resolves to on this machine. Under ``trainer.precision=auto`` the run keeps
    the precision its checkpoint recorded (bf16-mixed resumed on a machine without native bfloat16 stays
    bf16-mixed, emulated and slower, rather than switching its numerics midway), with one line saying so.
    A checkpoint that recorded none (written before precisions were recorded) resolves ``auto`` afresh.
    """
    if folder is None or cfg.trainer.precision != "auto" or cfg.trainer.get("dtype") is not None:
        return precision
    recorded = (ckpt.read_state(folder) or {}).get("precision")
    if recorded is None or recorded == precision.name:
        return precision
    device = torch.device(precision.device_type)
    check_device(recorded, device)
    if announce:
        say(f"trainer.precision=auto: continuing in {recorded}, what it resolved to for the run up to {folder.name} "
            f"(auto picks {precision.name} on this machine; a run keeps its precision across resumes)")
    return Precision(recorded, precision.device_type)


def apply_changes(changed: dict[str, tuple[Any, Any]], cfg: Any, updater: Any, kl_controller: Any,
                  fresh_base_lrs: list[float]) -> None:
    """Honour a new ``trainer.lr`` / ``trainer.steps`` / ``kl.coef`` after the checkpoint restored the old ones.

    ``kl_controller``: None for a run without one (``algorithm=reward_model``). ``fresh_base_lrs``: each parameter group's base learning rate as the new config built it (before the
    checkpoint's scheduler state replaced them). The current rates are recomputed from the schedule at its
    restored position, so a decaying schedule continues over the new ``trainer.steps``.
    """
    if "kl.coef" in changed and kl_controller is not None:
        kl_controller.coef = float(cfg.kl.coef)
    if "trainer.lr" in changed or "trainer.steps" in changed:
        optimizer, scheduler = updater.optimizer, updater.scheduler
        if "trainer.lr" in changed:
            scheduler.base_lrs = list(fresh_base_lrs)
        factors = getattr(scheduler, "lr_lambdas", None) or [lambda epoch: 1.0] * len(optimizer.param_groups)
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, factors, strict=True):
            group["initial_lr"] = base
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if changed and run_lock.is_rank_zero():
        shown = ", ".join(f"{key}: {_text(a)} -> {_text(b)}" for key, (a, b) in changed.items()
                          if key not in ("trainer.resume", "trainer.output_dir"))
        if shown:
            print(f"resuming with changed {shown}")


def prepare(cfg: Any, folder: Path | None, warn: bool = True) -> tuple[Path | None, dict[str, tuple[Any, Any]]]:
    """The checkpoint to resume from, verified (:func:`verified_checkpoint`), and the changes it honours."""
    if folder is None:
        return None, {}
    folder = verified_checkpoint(folder, warn=warn)
    return folder, check_changes(cfg, folder)


@contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Rank 0 holds ``run_dir``'s lock for the block; a refused resume puts Hydra's record back."""
    lock = run_lock.is_rank_zero()
    if lock:
        run_lock.acquire(run_dir)
    try:
        yield
    except ResumeRefused:
        if lock:
            restore_record()
        raise
    finally:
        if lock:
            run_lock.release(run_dir)


def claim_run_folder(cfg: Any, folder: Path | None, single_run: bool) -> None:
    """Before Hydra writes ``.hydra/`` into a named run folder: it is writable, this process holds its lock
    (a single run; a sweep's jobs take their own folders' locks), and a resume asks for no refused change."""
    if folder is None:
        return
    run_lock.check_writable(folder)
    if not single_run:
        return
    if run_lock.is_rank_zero():
        run_lock.acquire(folder)  # held until this process exits
    if cfg.trainer.resume:  # every rank: each stops at once rather than waiting for rank 0
        checkpoint = ckpt.resolve_resume(cfg.trainer.resume, Path(folder) / "checkpoints")
        if checkpoint is not None:
            check_changes(cfg, checkpoint)


def verified_checkpoint(folder: Path, warn: bool = True) -> Path:
    """``folder`` if its digests check out, else the newest earlier complete checkpoint that does.

    Each step back prints one warning line naming what was wrong and the step it fell back to; with
    nothing left, :class:`CheckpointError` says so in one line.
    """
    folder = Path(folder)
    root = folder.parent
    candidates = [folder, *reversed([c for c in ckpt.complete_checkpoints(root) if _step(c) < _step(folder)])]
    problems = []
    for candidate in candidates:
        problem = checkpoint_damage(candidate)
        if problem is None:
            if problems and warn:
                print(f"warning: checkpoint {problems[-1][0]} is damaged ({problems[-1][1]}); falling back to "
                      f"{candidate} (step {_step(candidate)})", file=sys.stderr, flush=True)
            return candidate
        problems.append((candidate, problem))
    raise CheckpointError(
        f"checkpoint {folder} is damaged ({problems[0][1]}) and no earlier complete checkpoint in {root} "
        "checks out; start a fresh run (another trainer.output_dir, without trainer.resume)"
    )


def checkpoint_damage(folder: Path) -> str | None:
    """What is wrong with checkpoint ``folder`` as every rank of the run sees it (the same answer on each; a
    collective under a process group). Each rank hashes only the shard files it reads (its own) and the small common
    files; the first rank that finds a problem is named with it."""
    rank, world = distributed.rank(), distributed.world_size()
    if world == 1:
        return damage(folder, ckpt.STATE_FILE)
    own = damage(folder, ckpt.STATE_FILE, hashes=lambda relative: hashed_by(relative, rank, world))
    found = distributed.gather_objects([own])
    return next((f"found by rank {index}: {problem}" for index, problem in enumerate(found) if problem), None)


def _step(folder: Path) -> int:
    match = ckpt.STEP_FOLDER.match(Path(folder).name)
    return int(match.group(1)) if match else -1


# ----------------------------------------------------------------------------- segment records (under Hydra)
def hydra_dir() -> Path | None:
    """The ``.hydra/`` folder of the running Hydra job, or None outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        config = HydraConfig.get()
    except (ImportError, ValueError):
        return None
    if not config.output_subdir:
        return None
    return Path(config.runtime.output_dir) / config.output_subdir


def record_segment(start_step: int, cfg: Any) -> None:
    """Keep this segment's resolved config and Hydra's files in ``.hydra/segments/from_step_N/``."""
    folder = hydra_dir()
    if folder is None or not run_lock.is_rank_zero():
        return
    segment = folder / SEGMENTS / f"from_step_{start_step}"
    segment.mkdir(parents=True, exist_ok=True)
    for name in HYDRA_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, segment / name)
    if not (segment / "config.yaml").is_file():
        (segment / "config.yaml").write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")


def restore_record() -> None:
    """After a refused resume: put the last segment's files back where Hydra had just rewritten them."""
    folder = hydra_dir()
    segments = sorted((folder / SEGMENTS).glob("from_step_*"), key=_segment_step) if folder else []
    if segments:
        for name in HYDRA_FILES:
            if (segments[-1] / name).is_file():
                shutil.copyfile(segments[-1] / name, folder / name)


def _segment_step(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[1]) if path.name.rsplit("_", 1)[1].isdigit() else -1
