"""Structured configs: the schema every composed Hydra config is checked against.

The dataclasses are registered in Hydra's ConfigStore as ``schema``; ``conf/config.yaml`` lists it first
in its defaults, so a key that is not here (a typo) or a value of the wrong type fails at composition.
Option names (``algorithm=grpo``) and value ranges are checked by :func:`validate`, before any model
loads, with one-line messages that name the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig


@dataclass
class AlgorithmConfig:
    name: str = MISSING
    group_size: int = 8  # samples per prompt; samples per step = prompts_per_step × group_size
    baseline: str = "group"  # group (GRPO) | none | batch_mean | loo (REINFORCE family)
    scale_by_std: bool = True  # GRPO divides by the group std; false = Dr. GRPO
    whiten_advantages: bool = False  # whiten advantages over the batch's valid tokens
    weight_by: str = "advantage"  # advantage | reward (TapeAgents rl_step option)
    clamp_negative_weights: bool = False  # weights below zero become zero
    clip_eps: float | None = 0.2  # null: no ratio clipping
    clip_eps_low: float | None = None  # defaults to clip_eps
    clip_eps_high: float | None = None  # defaults to clip_eps
    loss_aggregation: str = "token_mean"  # token_mean | sequence_mean
    epochs: int = 1  # optimisation passes over each rollout (PPO's ppo_epochs, GRPO's iterations)
    mini_batch_size: int = 0  # samples per optimizer update; 0 = the whole rollout
    entropy_coef: float = 0.0  # entropy bonus weight (full entropy from logits)
    # Actor-critic (PPO) fields; unused by critic-free algorithms.
    critic: str = "shared"  # shared (value head on the policy trunk) | separate
    critic_lr: float | None = None  # learning rate of the critic's parameters; null: trainer.lr
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.1
    clip_value: float | None = 0.2
    reward_clip: float | None = None
    normalize_scores: bool = False
    target_kl: float | None = None
    ratio_threshold: float | None = 10.0


@dataclass
class KLConfig:
    name: str = MISSING  # registered estimator: kl | abs | mse | k3 | full | none
    coef: float = 0.05
    placement: str = "loss"  # reward | loss
    controller: str = "fixed"  # fixed | adaptive
    target: float | None = None  # adaptive: target KL per sequence
    horizon: int = 10000  # adaptive: samples over which the error is corrected


@dataclass
class RewardConfig:
    name: str = MISSING
    target: str = "positive"  # sentiment: positive | negative
    model_path: str | None = None  # classifier / reward_model folder or hub id
    label: Any = None  # classifier label name or index
    output: str = "logit"  # classifier: logit | probability
    include_prompt: bool = False
    function: str | None = None  # python: module:function
    kwargs: dict[str, Any] = field(default_factory=dict)
    components: list[Any] = field(default_factory=list)  # composite: [{name, weight, key, ...}]
    min_words: int = 10
    max_words: int = 60
    slope_words: float = 20.0
    require_terminal_punctuation: bool = False
    format_weight: float = 0.0
    normalize: bool = False
    mean: float = 0.0
    std: float = 1.0
    batch_size: int = 32
    max_length: int = 512
    on_nonfinite: str = "error"  # error | drop: a NaN/inf score stops the run or drops that sample


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TinyModelConfig:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128


@dataclass
class ModelConfig:
    name: str = MISSING  # smollm2_135m | tiny | path
    name_or_path: str | None = None  # local folder or hub id (model=path), ignored by builtins
    system_prompt: str | None = None  # null: the chat template's default
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    lora: LoraConfig = field(default_factory=LoraConfig)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    name: str = MISSING  # movie_prompts | jsonl | csv | hub
    path: str | None = None  # file, folder or hub id; null for embedded sets
    prompt_column: str = "prompt"
    train_split: str = "train"
    eval_split: str = "eval"
    eval_fraction: float = 0.0  # >0: carve eval prompts out of train when there is no eval split
    max_prompt_tokens: int = 256


@dataclass
class LoggerConfig:
    name: str = MISSING  # none | wandb
    mode: str = "auto"  # auto (online with an API key, else offline) | online | offline | disabled
    project: str = "rlhf_lab"
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    job_type: str = "train"
    samples_every: int = 10  # steps between generation-sample tables


@dataclass
class TrainerConfig:
    steps: int = 30
    lr: float = 1e-5
    prompts_per_step: int = 2
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eval_every: int = 0  # 0: only at the end
    eval_prompts: int = 16
    checkpoint_every: int = 0  # 0: only at the end
    keep_last_n: int = 2
    resume: str | None = None  # null | auto | path to a checkpoint folder
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 | float16
    num_threads: int = 0  # torch intra-op threads; 0: torch's default
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine (after warmup)
    max_grad_norm: float | None = 1.0
    micro_batch_size: int = 0  # samples per forward/backward; 0 = the whole mini-batch
    samples_per_step_logged: int = 2  # rows appended to samples.jsonl each step
    max_consecutive_skips: int = 5  # non-finite loss/gradient skips before the run stops
    progress_bar: bool = True
    output_dir: str | None = None  # null: Hydra's run folder


@dataclass
class Config:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    experiment_name: str = "default"


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


class ConfigError(ValueError):
    """A config value that cannot run; the message is one line naming the key, value and what is allowed."""


def _choice(key: str, value: Any, valid: list[str] | tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose from: {', '.join(map(str, valid))}")


def _at_least(key: str, value: Any, minimum: float, strict: bool = False) -> None:
    if value is None:
        return
    if value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise ConfigError(f"{key}={value!r} is out of range; must be {relation} {minimum}")


def _check_known_keys(node: Any, schema: type, prefix: str) -> None:
    """Every key of ``node`` is a field of ``schema`` (recursively through nested dataclasses).

    Composition already rejects ``trainer.stepz=3``; this also catches keys added with Hydra's ``+``
    (``+trainer.stepz=3``), which would otherwise be carried along and silently ignored.
    """
    hints = typing.get_type_hints(schema)
    for key in node:
        full_key = f"{prefix}{key}"
        if key not in hints:
            where = f" of {prefix[:-1]}" if prefix else ""
            raise ConfigError(f"unknown key {full_key!r}; valid keys{where}: {', '.join(hints)}")
        child = node.get(key)
        if dataclasses.is_dataclass(hints[key]) and isinstance(child, Mapping | DictConfig):
            _check_known_keys(child, hints[key], f"{full_key}.")


def validate(cfg: Any) -> None:
    """Check option names and value ranges of a composed config; raise :class:`ConfigError` on the first bad one.

    Runs before any model loads. Option names come from the registry, so a newly registered part is
    valid as soon as it exists.
    """
    from pathlib import Path

    from rlhf_lab.registry import names

    _check_known_keys(cfg, Config, "")
    algorithm, kl, trainer = cfg.algorithm, cfg.kl, cfg.trainer
    _choice("algorithm", algorithm.name, names("algorithm"))
    _choice("kl", kl.name, names("kl"))
    _choice("kl.placement", kl.placement, names("kl_placement"))
    _choice("kl.controller", kl.controller, names("kl_controller"))
    _choice("reward", cfg.reward.name, names("reward"))
    _choice("logger", cfg.logger.name, names("logger"))
    _choice("logger.mode", cfg.logger.mode, ["auto", "online", "offline", "disabled"])
    _choice("algorithm.baseline", algorithm.baseline, ["group", "none", "batch_mean", "loo"])
    _choice("algorithm.loss_aggregation", algorithm.loss_aggregation, ["token_mean", "sequence_mean"])
    _choice("algorithm.weight_by", algorithm.weight_by, ["advantage", "reward"])
    _choice("algorithm.critic", algorithm.critic, ["shared", "separate"])
    _choice("trainer.dtype", trainer.dtype, ["float32", "bfloat16", "float16"])
    _choice("trainer.lr_schedule", trainer.lr_schedule, ["constant", "linear", "cosine"])
    _choice("reward.on_nonfinite", cfg.reward.on_nonfinite, ["error", "drop"])
    if not (trainer.device in ("auto", "cpu", "cuda", "mps") or str(trainer.device).startswith("cuda:")):
        raise ConfigError(f"trainer.device={trainer.device!r} is not valid; choose from: auto, cpu, cuda, cuda:N")

    _at_least("kl.coef", kl.coef, 0.0)
    _at_least("trainer.lr", trainer.lr, 0.0, strict=True)
    _at_least("trainer.steps", trainer.steps, 1)
    _at_least("trainer.prompts_per_step", trainer.prompts_per_step, 1)
    _at_least("trainer.max_new_tokens", trainer.max_new_tokens, 1)
    _at_least("trainer.temperature", trainer.temperature, 0.0, strict=True)
    _at_least("trainer.eval_every", trainer.eval_every, 0)
    _at_least("trainer.eval_prompts", trainer.eval_prompts, 0)
    _at_least("trainer.checkpoint_every", trainer.checkpoint_every, 0)
    _at_least("trainer.keep_last_n", trainer.keep_last_n, 1)
    _at_least("trainer.warmup_steps", trainer.warmup_steps, 0)
    _at_least("trainer.weight_decay", trainer.weight_decay, 0.0)
    _at_least("trainer.max_grad_norm", trainer.max_grad_norm, 0.0, strict=True)
    _at_least("trainer.micro_batch_size", trainer.micro_batch_size, 0)
    _at_least("trainer.max_consecutive_skips", trainer.max_consecutive_skips, 1)
    _at_least("algorithm.group_size", algorithm.group_size, 1)
    _at_least("algorithm.epochs", algorithm.epochs, 1)
    _at_least("algorithm.mini_batch_size", algorithm.mini_batch_size, 0)
    _at_least("algorithm.entropy_coef", algorithm.entropy_coef, 0.0)
    _at_least("algorithm.vf_coef", algorithm.vf_coef, 0.0)
    _at_least("algorithm.critic_lr", algorithm.critic_lr, 0.0, strict=True)
    _at_least("algorithm.clip_value", algorithm.clip_value, 0.0, strict=True)
    _at_least("algorithm.reward_clip", algorithm.reward_clip, 0.0, strict=True)
    _at_least("algorithm.target_kl", algorithm.target_kl, 0.0, strict=True)
    _at_least("algorithm.ratio_threshold", algorithm.ratio_threshold, 0.0, strict=True)
    _at_least("model.lora.r", cfg.model.lora.r, 1)
    if not 0.0 < trainer.top_p <= 1.0:
        raise ConfigError(f"trainer.top_p={trainer.top_p!r} is out of range; must be in (0, 1]")
    for key in ("clip_eps", "clip_eps_low", "clip_eps_high"):
        value = algorithm[key]
        if value is not None and not 0.0 < value < 1.0:
            raise ConfigError(f"algorithm.{key}={value!r} is out of range; must be in (0, 1) or null")
    for key in ("gamma", "lam"):
        if not 0.0 <= algorithm[key] <= 1.0:
            raise ConfigError(f"algorithm.{key}={algorithm[key]!r} is out of range; must be in [0, 1]")
    group_based = algorithm.baseline in ("group", "loo")
    if group_based and algorithm.group_size < 2:
        raise ConfigError(
            f"algorithm.group_size={algorithm.group_size} is too small for algorithm={algorithm.name} "
            f"(baseline {algorithm.baseline}); must be >= 2"
        )
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
    if kl.controller == "adaptive" and (kl.target is None or kl.target <= 0):
        raise ConfigError(f"kl.target={kl.target!r} must be > 0 with kl.controller=adaptive")
    _at_least("kl.horizon", kl.horizon, 1)
    if cfg.model.name == "path" or cfg.model.name_or_path:
        path = cfg.model.name_or_path
        if path is None:
            raise ConfigError("model.name_or_path=None: model=path needs a local folder or hub id")
        if (path.startswith((".", "/", "~")) or Path(path).exists()) and not Path(path).expanduser().is_dir():
            raise ConfigError(f"model.name_or_path={path!r} is not a folder")
        _check_model_location("model.name_or_path", path)
    if cfg.data.name in ("jsonl", "csv") and (not cfg.data.path or not Path(cfg.data.path).exists()):
        raise ConfigError(f"data.path={cfg.data.path!r} does not exist (data={cfg.data.name})")
    if cfg.reward.name in ("classifier", "reward_model"):
        path = cfg.reward.model_path
        if not path:
            raise ConfigError(f"reward.model_path={path!r}: reward={cfg.reward.name} needs a model folder or hub id")
        if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
            raise ConfigError(f"reward.model_path={path!r} is not a folder")
        _check_model_location("reward.model_path", path)
    if cfg.reward.name == "python":
        function = cfg.reward.function
        if not function or ":" not in function:
            raise ConfigError(f"reward.function={function!r} must be 'module:function'")
        _check_function("reward.function", function)
    for index, component in enumerate(cfg.reward.components if cfg.reward.name == "composite" else []):
        if isinstance(component, Mapping) and component.get("name") == "python":
            _check_function(f"reward.components[{index}].function", component.get("function"))
    if cfg.reward.name == "sentiment":
        _choice("reward.target", cfg.reward.target, ["positive", "negative"])
    _at_least("trainer.top_k", trainer.top_k, 0)
    _at_least("trainer.samples_per_step_logged", trainer.samples_per_step_logged, 0)
    _at_least("data.max_prompt_tokens", cfg.data.max_prompt_tokens, 1)
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction!r} is out of range; must be in [0, 1)")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= trainer[key] < 1.0:
            raise ConfigError(f"trainer.{key}={trainer[key]!r} is out of range; must be in [0, 1)")
    if trainer.resume and trainer.resume != "auto":
        from rlhf_lab.checkpoint import CheckpointError, resolve_resume

        try:
            resolve_resume(trainer.resume, Path(trainer.resume))
        except CheckpointError as error:
            raise ConfigError(str(error)) from None


def _hub_offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _check_model_location(key: str, path: str) -> None:
    """A local model folder must hold a saved model; a hub id must be cached when the hub is offline."""
    from pathlib import Path

    folder = Path(path).expanduser()
    if folder.is_dir():
        if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
            raise ConfigError(f"{key}={path!r} has no config.json; it must be a folder written by save_pretrained")
        return
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ConfigError(f"{key}={path!r} is not a folder")
    if _hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ConfigError(
                f"{key}={path!r} is not a local folder, and as a hub id it is not in the local cache "
                "(HF_HUB_OFFLINE=1)"
            )


def _check_function(key: str, spec: Any) -> None:
    """Import a ``module:function`` spec now, so a typo fails before any model loads.

    This imports user code named in the config (by design: a ``python`` reward runs it anyway).
    """
    from rlhf_lab.rewards.python_function import load_function

    try:
        load_function(spec)
    except ValueError as error:
        raise ConfigError(f"{key}={spec!r}: {str(error).split(': ', 1)[-1]}") from None
