"""Choices, ranges and cross-field rules of a composed config; no file, network or user code is touched.

Valid choices come from the registry (the built-ins register when :mod:`rlhf_lab.components` is imported)
or from the module that owns the concept, so a newly registered part is valid as soon as it exists.
A field some options lack (``algorithm.baseline``, ``algorithm.gamma``, ...) is checked when the option's
schema has it, never by the option's name.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import rlhf_lab.components  # noqa: F401  (registers the built-in parts, whose names are the valid choices)
from rlhf_lab.algorithms.advantages import REMAX_RETURNS
from rlhf_lab.algorithms.base import WEIGHT_SOURCES
from rlhf_lab.algorithms.losses import BANDED, CORRECTIONS
from rlhf_lab.algorithms.ppo import CRITICS
from rlhf_lab.config.choices import (
    DEVICES,
    EXACT_KL,
    LOGPROB_SOURCES,
    LR_SCHEDULES,
    MAX_STALENESS,
    ON_NONFINITE,
    SIMULATES_STALENESS,
    WEIGHT_SYNC,
    sync_folder_needed,
)
from rlhf_lab.config.suggest import did_you_mean
from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.inflight import OVER_CAP, WEIGHT_UPDATES
from rlhf_lab.registry import get, names
from rlhf_lab.rewards.classifier import OUTPUTS
from rlhf_lab.rewards.rescale import ANCHORS as RESCALE_ANCHORS
from rlhf_lab.rewards.sentiment import TARGETS
from rlhf_lab.trackers.wandb_run import MODES
from rlhf_lab.training.save_policy import SAVE_POLICIES


def choice(key: str, value: Any, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; {did_you_mean(value, valid)}"
                          f"choose from: {', '.join(map(str, valid))}")


def at_least(key: str, value: Any, minimum: float, strict: bool = False) -> None:
    """``value >= minimum`` (``>`` when strict) and finite; None (an optional field left out) passes."""
    if value is None:
        return
    relation = ">" if strict else ">="
    if isinstance(value, float) and not math.isfinite(value):  # NaN compares false with everything
        raise ConfigError(f"{key}={value!r} is not a finite number; must be {relation} {minimum}")
    if value < minimum or (strict and value == minimum):
        raise ConfigError(f"{key}={value!r} is out of range; must be {relation} {minimum}")


def check_choices(cfg: Any) -> None:
    algorithm, kl, reward, trainer = cfg.algorithm, cfg.kl, cfg.reward, cfg.trainer
    choice("algorithm", algorithm.name, names("algorithm"))
    choice("kl", kl.name, names("kl"))
    choice("kl.placement", kl.placement, names("kl_placement"))
    choice("kl.controller", kl.controller, names("kl_controller"))
    choice("reward", reward.name, names("reward"))
    choice("reward.rescale", reward.get("rescale", "none"), names("reward_rescale"))
    if reward.get("rescale", "none") != "none" and reward.get("rescale_threshold") is None:
        raise ConfigError(f"reward.rescale={reward.rescale} rescores the samples at or above "
                          "reward.rescale_threshold, which is null: set it (e.g. reward.rescale_threshold=1.0)")
    if reward.get("rescale", "none") != "none":  # it rescores a prompt's group of sampled responses
        if getattr(get("algorithm", algorithm.name), "offline", False):
            raise ConfigError(f"reward.rescale={reward.rescale} rescores sampled responses, which "
                              f"algorithm={algorithm.name} does not draw (it learns from data): use reward.rescale=none")
        choice("reward.rescale_anchor", reward.get("rescale_anchor", "batch"), RESCALE_ANCHORS)
        if reward.get("rescale_anchor", "batch") == "group" and algorithm.get("group_size", 1) < 2:
            raise ConfigError(f"reward.rescale={reward.rescale} with reward.rescale_anchor=group rescores within a "
                              f"prompt's group of samples, and algorithm.group_size={algorithm.get('group_size', 1)} "
                              "gives it one: use algorithm.group_size of 2 or more, reward.rescale_anchor=batch, or "
                              "reward.rescale=none")
    choice("logger", cfg.logger.name, names("logger"))
    choice("logger.mode", cfg.logger.mode, MODES)
    choice("algorithm.loss_aggregation", algorithm.loss_aggregation, names("loss_aggregation"))
    if not getattr(get("algorithm", algorithm.name), "offline", False):  # sft, dpo, reward_model learn from data
        choice("algorithm.advantage", algorithm.advantage, names("advantage"))
    choice("algorithm.policy_loss", algorithm.policy_loss, names("policy_loss"))
    choice("algorithm.tis_mode", algorithm.get("tis_mode", "token_truncate"), CORRECTIONS)
    choice("generation", cfg.generation.name, names("generation"))
    if cfg.generation.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("generation=vllm needs vLLM, which is not installed: pip install -r requirements-vllm.txt "
                          "(or make install-vllm); generation=hf needs nothing more")
    if cfg.generation.name == "vllm_server":
        choice("generation.weight_sync", cfg.generation.weight_sync, WEIGHT_SYNC)
        lora = bool(cfg.model.get("lora", {}).get("enabled", False))
        if not cfg.generation.get("sync_folder") and (cfg.generation.weight_sync == "folder" or lora):
            raise ConfigError(sync_folder_needed(lora))
    choice("generation.logprobs", cfg.generation.get("logprobs", "auto"), LOGPROB_SOURCES)
    if cfg.generation.get("logprobs") == "sampler" and (trainer.top_p < 1.0 or trainer.top_k):
        raise ConfigError(f"generation.logprobs=sampler with trainer.top_p={trainer.top_p} / trainer.top_k="
                          f"{trainer.top_k}: the sampler's log-probs are of the truncated distribution it drew from, "
                          "not of the policy softmax(logits / T) the trainer trains, so π_old would not be π_θ's; use "
                          "generation.logprobs=auto or trainer (the engine's kept as μ for algorithm.tis_cap), or "
                          "trainer.top_p=1.0 and trainer.top_k=0")
    if cfg.generation.get("logprobs") == "sampler" and algorithm.get("tis_cap") is not None:
        raise ConfigError(f"algorithm.tis_cap={algorithm.tis_cap} corrects the sampler's log-probs towards the "
                          "trainer's, which generation.logprobs=sampler does not compute: use generation.logprobs="
                          "auto or trainer, or algorithm.tis_cap=null")
    choice("kl.exact", kl.get("exact", "step"), EXACT_KL)
    staleness = cfg.generation.get("max_staleness", 0)
    if not isinstance(staleness, int) or isinstance(staleness, bool) or not 0 <= staleness <= MAX_STALENESS:
        raise ConfigError(f"generation.max_staleness={staleness!r} is out of range; must be an integer from 0 "
                          f"(on-policy) to {MAX_STALENESS} (updates between the weights that sample a batch and those "
                          "that train on it)")
    simulate = cfg.generation.get("simulate_staleness", False)
    if simulate and not staleness:
        raise ConfigError("generation.simulate_staleness=true with generation.max_staleness=0 has no lag to simulate: "
                          f"set generation.max_staleness to 1–{MAX_STALENESS}, or generation.simulate_staleness=false")
    if simulate and cfg.generation.name not in SIMULATES_STALENESS:
        raise ConfigError(f"generation.simulate_staleness=true with generation={cfg.generation.name}: a server engine "
                          "lags for real (it samples while the trainer trains); simulate_staleness works with "
                          f"generation={' or '.join(SIMULATES_STALENESS)}, or set generation.simulate_staleness=false")
    if simulate and cfg.trainer.strategy == "fsdp":
        raise ConfigError("generation.simulate_staleness=true with trainer.strategy=fsdp: the snapshots keep whole "
                          "weights, which FSDP shards; use trainer.strategy=ddp, or generation.simulate_staleness=false")
    check_weight_updates(cfg, simulate)
    if staleness and algorithm.get("dynamic_sampling"):
        raise ConfigError(f"generation.max_staleness={staleness} samples each batch {staleness} step(s) before its "
                          "own, and algorithm.dynamic_sampling=true refills a batch by sampling within its own step: "
                          "use one of them (generation.max_staleness=0, or algorithm.dynamic_sampling=false)")
    has_critic = "critic" in algorithm
    if has_critic and algorithm.advantage != "gae":
        raise ConfigError(f"algorithm.advantage={algorithm.advantage!r} does not fit algorithm={algorithm.name}, "
                          "whose critic estimates advantages: it needs algorithm.advantage=gae")
    if not has_critic and algorithm.advantage == "gae":
        raise ConfigError(f"algorithm.advantage=gae needs a critic, which algorithm={algorithm.name} has not; "
                          "use algorithm=ppo")
    if "baseline" in algorithm:
        choice("algorithm.baseline", algorithm.baseline, names("baseline"))
    if "weight_by" in algorithm:
        choice("algorithm.weight_by", algorithm.weight_by, WEIGHT_SOURCES)
        choice("algorithm.remax_return", algorithm.remax_return, REMAX_RETURNS)
        at_least("algorithm.std_eps", algorithm.std_eps, 0.0, strict=True)
    if "critic" in algorithm:
        choice("algorithm.critic", algorithm.critic, CRITICS)
    choice("trainer.lr_schedule", trainer.lr_schedule, LR_SCHEDULES)
    choice("trainer.save", trainer.save, SAVE_POLICIES)
    choice("reward.on_nonfinite", reward.on_nonfinite, ON_NONFINITE)
    if "target" in reward:
        choice("reward.target", reward.target, TARGETS)
    if "output" in reward:
        choice("reward.output", reward.output, OUTPUTS)
    if not (trainer.device in DEVICES or str(trainer.device).startswith("cuda:")):
        raise ConfigError(f"trainer.device={trainer.device!r} is not valid; choose from: auto, cpu, cuda, cuda:N")


# Policy losses with no −A·r term for Dual-clip to bound: REINFORCE's −A·log π, CISPO's −sg(clip(r))·A·log π.
NO_DUAL_CLIP = ("reinforce", "cispo", "dppo")


def check_ranges(cfg: Any) -> None:
    algorithm, kl, trainer = cfg.algorithm, cfg.kl, cfg.trainer
    at_least("kl.coef", kl.coef, 0.0)
    at_least("trainer.lr", trainer.lr, 0.0, strict=True)
    at_least("trainer.steps", trainer.steps, 1)
    at_least("trainer.max_train_seconds", trainer.max_train_seconds, 0.0, strict=True)  # null: no budget
    at_least("trainer.collective_timeout_s", trainer.collective_timeout_s, 0.0, strict=True)
    at_least("trainer.prompts_per_step", trainer.prompts_per_step, 1)
    at_least("trainer.max_new_tokens", trainer.max_new_tokens, 1)
    at_least("trainer.temperature", trainer.temperature, 0.0, strict=True)
    at_least("trainer.eval_every", trainer.eval_every, 0)
    at_least("trainer.eval_prompts", trainer.eval_prompts, 0)
    at_least("trainer.checkpoint_every", trainer.checkpoint_every, 0)
    at_least("trainer.keep_last_n", trainer.keep_last_n, 1)
    at_least("trainer.warmup_steps", trainer.warmup_steps, 0)
    at_least("trainer.weight_decay", trainer.weight_decay, 0.0)
    at_least("trainer.max_grad_norm", trainer.max_grad_norm, 0.0, strict=True)
    at_least("trainer.micro_batch_size", trainer.micro_batch_size, 0)
    at_least("trainer.max_consecutive_skips", trainer.max_consecutive_skips, 1)
    at_least("algorithm.group_size", algorithm.group_size, 1)
    at_least("algorithm.epochs", algorithm.epochs, 1)
    at_least("algorithm.mini_batch_size", algorithm.mini_batch_size, 0)
    at_least("algorithm.entropy_coef", algorithm.entropy_coef, 0.0)
    at_least("algorithm.vf_coef", algorithm.get("vf_coef"), 0.0)
    for key in ("critic_lr", "clip_value", "reward_clip", "target_kl", "ratio_threshold"):
        at_least(f"algorithm.{key}", algorithm.get(key), 0.0, strict=True)
    at_least("model.lora.r", cfg.model.lora.r, 1)
    if not 0.0 < trainer.top_p <= 1.0:
        raise ConfigError(f"trainer.top_p={trainer.top_p!r} is out of range; must be in (0, 1]")
    if algorithm.clip_eps_high is not None:
        at_least("algorithm.clip_eps_high", algorithm.clip_eps_high, 0.0, strict=True)
    at_least("algorithm.clip_ratio_c", algorithm.clip_ratio_c, 1.0, strict=True)
    if algorithm.clip_ratio_c is not None and algorithm.get("policy_loss") in NO_DUAL_CLIP:
        raise ConfigError(
            f"algorithm.clip_ratio_c={algorithm.clip_ratio_c!r} bounds the ratio term −A·r of a ratio loss, and "
            f"algorithm.policy_loss={algorithm.policy_loss!r} has none; use policy_loss clip or gspo, or "
            "clip_ratio_c=null")
    at_least("algorithm.tis_cap", algorithm.tis_cap, 0.0, strict=True)
    check_off_policy(algorithm)
    at_least("algorithm.max_refill_rounds", algorithm.max_refill_rounds, 0)
    at_least("algorithm.overlong_penalty", algorithm.overlong_penalty, 0.0)
    at_least("algorithm.overlong_window", algorithm.overlong_window, 0)
    for key in ("clip_eps", "clip_eps_low"):
        value = algorithm[key]
        if value is not None and not 0.0 < value < 1.0:
            raise ConfigError(f"algorithm.{key}={value!r} is out of range; must be in (0, 1) or null")
    for key in ("gamma", "lam"):
        if key in algorithm and not 0.0 <= algorithm[key] <= 1.0:
            raise ConfigError(f"algorithm.{key}={algorithm[key]!r} is out of range; must be in [0, 1]")
    if kl.controller == "adaptive" and (kl.target is None or not kl.target > 0):
        raise ConfigError(f"kl.target={kl.target!r} must be > 0 with kl.controller=adaptive")
    at_least("kl.horizon", kl.horizon, 1)
    at_least("trainer.top_k", trainer.top_k, 0)
    at_least("trainer.samples_per_step_logged", trainer.samples_per_step_logged, 0)
    at_least("data.max_prompt_tokens", cfg.data.max_prompt_tokens, 1)
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction!r} is out of range; must be in [0, 1)")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= trainer[key] < 1.0:
            raise ConfigError(f"trainer.{key}={trainer[key]!r} is out of range; must be in [0, 1)")
    check_generation_ranges(cfg.get("generation") or {})


def check_generation_ranges(generation: Any) -> None:
    """The engine's sizes: the canary's tolerance, the GPU memory share, the tensor-parallel size (whether it divides
    the ranks is known at launch: :class:`rlhf_lab.generation.vllm.TensorParallel`)."""
    if generation.get("sync_check_tol") is not None:
        at_least("generation.sync_check_tol", generation.sync_check_tol, 0.0)
    if "gpu_memory_utilization" in generation:
        share = generation.gpu_memory_utilization
        if not (isinstance(share, float | int) and 0.0 < share <= 1.0):
            raise ConfigError(f"generation.gpu_memory_utilization={share!r} is out of range; must be a share of the "
                              "GPU's memory in (0, 1], e.g. 0.35")
    if "tensor_parallel_size" in generation:
        at_least("generation.tensor_parallel_size", generation.tensor_parallel_size, 1)


def check_batch_shape(cfg: Any) -> None:
    """Group size against what the algorithm needs; mini- and micro-batches dividing the step's samples."""
    algorithm, trainer = cfg.algorithm, cfg.trainer
    min_group_size = getattr(get("algorithm", algorithm.name), "min_group_size", None)
    minimum = min_group_size(algorithm) if min_group_size is not None else 1
    if algorithm.group_size < minimum:
        raise ConfigError(
            f"algorithm.group_size={algorithm.group_size} is too small for algorithm={algorithm.name}; "
            f"must be >= {minimum}"
        )
    if algorithm.dynamic_sampling and algorithm.group_size < 2:
        raise ConfigError(f"algorithm.dynamic_sampling=true compares samples within a prompt group; "
                          f"algorithm.group_size={algorithm.group_size} must be >= 2")
    samples = trainer.prompts_per_step * algorithm.group_size
    if algorithm.mini_batch_size and samples % algorithm.mini_batch_size:
        raise ConfigError(
            f"algorithm.mini_batch_size={algorithm.mini_batch_size} does not divide the {samples} samples per step "
            f"(trainer.prompts_per_step={trainer.prompts_per_step} x algorithm.group_size={algorithm.group_size})"
        )
    if trainer.micro_batch_size and (algorithm.mini_batch_size or samples) % trainer.micro_batch_size:
        raise ConfigError(
            f"trainer.micro_batch_size={trainer.micro_batch_size} does not divide the mini-batch of "
            f"{algorithm.mini_batch_size or samples} samples"
        )


def check_values(cfg: Any) -> None:
    """Choices, then ranges, then batch shapes: the first bad value raises a one-line ConfigError."""
    check_choices(cfg)
    check_ranges(cfg)
    check_batch_shape(cfg)


def check_off_policy(algorithm: Any) -> None:
    """The off-policy corrections' own settings (rlhf_lab/algorithms/off_policy.py): a band's floor below its cap and
    only where a band is used, M2PO's τ and DPPO's τ positive, the V3.2 threshold not negative."""
    mode, cap, floor = algorithm.get("tis_mode", "token_truncate"), algorithm.get("tis_cap"), algorithm.get("tis_floor")
    if mode in ("icepop", "geo_mask", "m2po") and cap is None:
        raise ConfigError(f"algorithm.tis_mode={mode} needs algorithm.tis_cap (the upper bound of its band, or M2PO's "
                          "behaviour-weight cap; e.g. 5 for IcePop and M2PO, 1.001 for Geo-RS); it is null")
    if floor is not None:
        if mode not in BANDED:
            raise ConfigError(f"algorithm.tis_floor={floor} is the lower bound of a band, and algorithm.tis_mode={mode} "
                              f"has none: use tis_mode {' or '.join(BANDED)}, or tis_floor=null")
        if cap is not None and not 0.0 < floor < cap:
            raise ConfigError(f"algorithm.tis_floor={floor} is out of range; must be in (0, algorithm.tis_cap={cap})")
    at_least("algorithm.m2po_tau", algorithm.get("m2po_tau", 0.04), 0.0, strict=True)
    at_least("algorithm.dppo_tau", algorithm.get("dppo_tau", 0.0), 0.0)
    at_least("algorithm.off_policy_mask", algorithm.get("off_policy_mask"), 0.0)


def check_weight_updates(cfg: Any, simulate: bool) -> None:
    """``generation.weight_updates`` in flight or partial (rlhf_lab/generation/inflight.py): the simulator lands the
    ring's newer versions between the ``hf`` decode's steps, so it needs the ring, that decode, and weights the decode
    reads from the policy itself."""
    generation = cfg.generation
    mode, every = generation.get("weight_updates", "batch"), generation.get("update_every_tokens", 0)
    choice("generation.weight_updates", mode, WEIGHT_UPDATES)
    check_staleness_cap(cfg, simulate)
    if mode == "batch":
        return
    if generation.name == "vllm_server":  # for real: the server takes each version between its decode steps
        if not generation.get("max_staleness", 0) and not generation.get("continuous", False):
            raise ConfigError(f"generation.weight_updates={mode} with generation=vllm_server lands each update in the "
                              "batches the server samples ahead, and generation.max_staleness=0 samples none ahead: "
                              f"set generation.max_staleness to 1–{MAX_STALENESS} (the batches in flight), or "
                              "generation.continuous=true (groups in flight)")
        if every:
            raise ConfigError(f"generation.update_every_tokens={every!r} scripts the simulator's clock; with "
                              "generation=vllm_server a version lands when the trainer publishes it: leave it 0")
        if cfg.model.get("lora", {}).get("enabled", False):
            raise ConfigError(f"generation.weight_updates={mode} sends full weights between decode steps; a LoRA "
                              "adapter reaches the server between requests: set generation.weight_updates=batch")
        return
    if generation.get("continuous", False):  # rlhf_lab/config/validate_async.py checks the rest
        return
    if not simulate:
        raise ConfigError(f"generation.weight_updates={mode} lands the weights of newer updates mid-generation from the "
                          "snapshots generation.simulate_staleness=true keeps: set it (with generation.max_staleness "
                          "≥ 1), or generation.weight_updates=batch")
    if generation.name != "hf":
        raise ConfigError(f"generation.weight_updates={mode} with generation={generation.name}: the simulated updates "
                          "land between the hf engine's decode steps; use generation=hf")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"generation.update_every_tokens={every!r} is out of range; generation.weight_updates={mode} "
                          "needs an integer ≥ 1 (decode steps between two weight updates landing)")
    if cfg.get("hardware", {}).get("generation_weights", False):
        raise ConfigError(f"generation.weight_updates={mode} with hardware.generation_weights=true: the decode would "
                          "read its prepared copy of the weights, which a landing update does not change; use "
                          "hardware=default or hardware.generation_weights=false")


def check_staleness_cap(cfg: Any, simulate: bool) -> None:
    """``generation.staleness_cap`` (an integer ≥ 1) and ``generation.over_cap``: the cap reads the oldest token of
    the batches sampled ahead (generation.max_staleness ≥ 1), whose lag varies only where they are not simulated."""
    generation = cfg.generation
    cap = generation.get("staleness_cap")
    choice("generation.over_cap", generation.get("over_cap", "drop"), OVER_CAP)
    if cap is None:
        return
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ConfigError(f"generation.staleness_cap={cap!r} is out of range; an integer ≥ 1 (updates a sample's "
                          "oldest token may be behind the policy that trains on it), or null for no cap")
    if not generation.get("max_staleness", 0) and not generation.get("continuous", False):
        raise ConfigError(f"generation.staleness_cap={cap} with generation.max_staleness=0: every batch is sampled by "
                          "the weights it trains, nothing is ever stale; set generation.max_staleness ≥ 1, or "
                          "generation.staleness_cap=null")
    if simulate:
        raise ConfigError(f"generation.staleness_cap={cap} with generation.simulate_staleness=true: the simulator's "
                          "oldest token is always max_staleness updates behind; set the lag with "
                          "generation.max_staleness, or generation.staleness_cap=null")
