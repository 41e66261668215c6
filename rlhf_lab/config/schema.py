"""Structured configs: one dataclass per option of every config group, stored in Hydra's ConfigStore.

Hydra's structured-config schema pattern: the root :class:`Config` types each group with its base
dataclass (``algorithm: AlgorithmConfig = MISSING``); every option's dataclass subclasses that base and is
stored under the group as ``<option>_schema``; every option's YAML names its schema first in its own
defaults list (``conf/algorithm/grpo.yaml``: ``defaults: [grpo_schema, _self_]``). So the composed
``cfg.algorithm`` has the option's own type (``OmegaConf.get_type(cfg.algorithm) is GRPOConfig``), and a
key of another option (``algorithm=ppo algorithm.weight_by=reward``) is unknown there.

Fields are plain data with their defaults; the values a choice field accepts are listed once, in the
registry or in the module that owns the concept, and checked by :mod:`rlhf_lab.config.validate_values`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rlhf_lab.config.schema_env import ENV_SCHEMAS, EnvConfig
from rlhf_lab.config.schema_reward import (
    ClassifierRewardConfig,
    CompositeRewardConfig,
    ExactTableRewardConfig,
    LengthRewardConfig,
    MathVerifyRewardConfig,
    PairwiseRewardConfig,
    PythonRewardConfig,
    ReasoningGymRewardConfig,
    RewardConfig,
    RewardModelConfig,
    RouteRewardConfig,
    SentimentRewardConfig,
)
from rlhf_lab.config.schema_run import (
    EvalConfig,
    GenerationConfig,
    HardwareConfig,
    TrainerConfig,
    VLLMGenerationConfig,
    VLLMServerGenerationConfig,
)

# ------------------------------------------------------------------------------------------------ algorithm


@dataclass
class AlgorithmConfig:
    """What every algorithm reads: sampling groups, ratio clipping, loss reduction, update epochs."""

    name: str = MISSING  # registered algorithm (a preset composing the axes below)
    advantage: str = MISSING  # registered kind `advantage` (rlhf_lab/algorithms/advantages.py); ppo: gae
    policy_loss: str = "clip"  # registered kind `policy_loss`: clip | gspo | cispo | reinforce
    clip_ratio_c: float | None = None  # Dual-clip c (> 1): negative-advantage tokens' loss at most −c·A
    tis_cap: float | None = None  # sampler-trainer correction: cap C of the importance weights (e.g. 2); null: off
    # token_truncate | token_mask (AReaL's decoupled PPO) | sequence_truncate | sequence_mask | icepop | geo_mask | m2po
    # | none (rlhf_lab/algorithms/losses.py::sampler_correction, rlhf_lab/algorithms/off_policy.py)
    tis_mode: str = "token_truncate"
    tis_floor: float | None = None  # icepop / geo_mask: the band's lower bound; null: 1 / tis_cap
    m2po_tau: float = 0.04  # tis_mode=m2po: the second moment of log(π_old/μ) the kept tokens stay below
    off_policy_mask: float | None = None  # DeepSeek-V3.2's δ: negative-advantage samples with mean log(μ/π) > δ masked
    dppo_tau: float = 1e-3  # policy_loss=dppo: weight of its τ·(log π/μ)² term
    group_size: int = 8  # samples per prompt; samples per step = prompts_per_step × group_size
    clip_eps: float | None = 0.2  # null: no ratio clipping
    clip_eps_low: float | None = None  # defaults to clip_eps
    clip_eps_high: float | None = None  # defaults to clip_eps
    loss_aggregation: str = "token_mean"  # registered kind `loss_aggregation`
    epochs: int = 1  # optimisation passes over each rollout (PPO's ppo_epochs, GRPO's iterations)
    mini_batch_size: int = 0  # samples per optimizer update; 0 = the whole rollout
    entropy_coef: float = 0.0  # entropy bonus weight (full entropy from logits)
    whiten_advantages: bool = False  # whiten advantages over the batch's valid tokens
    # DAPO's sampling rules (rlhf_lab/step/sampling.py)
    dynamic_sampling: bool = False  # drop prompt groups whose scores are all equal; refill from further prompts
    max_refill_rounds: int = 3  # extra generation rounds per step for dynamic sampling
    overlong_window: int = 0  # soft overlong penalty over the last N tokens up to max_new_tokens (0: off; capped at it)
    overlong_penalty: float = 1.0  # the penalty at max_new_tokens (linear from 0 at the window's start)
    mask_truncated: bool = False  # responses cut at max_new_tokens (no EOS) take no part in the loss


@dataclass
class CriticFreeConfig(AlgorithmConfig):
    """Policy-gradient algorithms without a critic: what weighs ∇log π."""

    weight_by: str = "advantage"  # rlhf_lab.algorithms.base.WEIGHT_SOURCES (TapeAgents rl_step option)
    clamp_negative_weights: bool = False  # weights below zero become zero
    scale_by_std: bool = True  # advantage=grpo: divide by the group std (false: Dr. GRPO's centring only)
    std_eps: float = 1e-4  # advantage=grpo: A = (R − mean) / (std + std_eps); TRL's 1e-4 (verl: 1e-6)
    remax_return: str = "total"  # advantage=remax: total (R on every token) | to_go (reward-to-go, as verl)
    baseline: str = "batch_mean"  # advantage=reinforce: registered kind `baseline` (none | batch_mean | loo)


@dataclass
class GRPOConfig(CriticFreeConfig):
    """GRPO and its relatives (dr_grpo, gspo, cispo): group-relative advantages."""


@dataclass
class ReinforceConfig(CriticFreeConfig):
    """REINFORCE, RLOO and REINFORCE++ (``algorithm=rloo``: the leave-one-out advantage)."""


@dataclass
class PPOConfig(AlgorithmConfig):
    """Actor-critic PPO: a value head or a separate critic, GAE, clipped value loss."""

    critic: str = "shared"  # rlhf_lab.algorithms.ppo.CRITICS
    critic_lr: float | None = None  # learning rate of the critic's parameters; null: trainer.lr
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.1
    clip_value: float | None = 0.2
    reward_clip: float | None = None
    normalize_scores: bool = False
    target_kl: float | None = None
    ratio_threshold: float | None = 10.0


# ----------------------------------------------------------------------------------------------------- kl


LARGE_KL_COEF = 1e3  # a kl.coef beyond it leaves the task reward nothing to move (a warning; named at overflow)


@dataclass
class KLConfig:
    """Every KL option shares this schema (``kl_schema``)."""

    name: str = MISSING  # registered kind `kl`
    coef: float = 0.05
    placement: str = "loss"  # registered kind `kl_placement`
    controller: str = "fixed"  # registered kind `kl_controller`
    target: float | None = None  # adaptive: target KL per sequence
    horizon: int = 10000  # adaptive: samples over which the error is corrected
    # Options of the loss-placed KL term (rlhf_lab/kl/estimators.py), off by default:
    clamp_log_ratio: float | None = None  # bound log r to [-c, c] before the estimator (verl: 20)
    clamp_value: float | None = None  # bound the estimate to [-c, c] (verl clamps k3 to 10)
    importance_weight: bool = False  # weight the estimate by sg(pi_theta / pi_old) (off-policy epochs/mini-batches)
    loss_scale: str = "none"  # none | advantage: the loss-placed term scaled as the advantages scale the reward
    off_policy_correction: str = "policy"  # registered kind `kl_correction`: policy | none | token_ratio | prefix_ratio
    exact: str = "step"  # the exact KL from full logits (kl/exact): every step | eval only | off


# -------------------------------------------------------------------------------------------------- model


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
class TinyDims:
    """Sizes of the tiny random Llama (``model=tiny``)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128


@dataclass
class ModelConfig:
    """``smollm2_135m`` and ``path`` use this schema as it is."""

    name: str = MISSING  # smollm2_135m | tiny | exact | path
    name_or_path: str | None = None  # local folder or hub id (model=path), ignored by builtins
    system_prompt: str | None = None  # null: the chat template's default
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TinyModelConfig(ModelConfig):
    tiny: TinyDims = field(default_factory=TinyDims)


@dataclass
class ExactTaskDims:
    """The exact task's policy (``model=exact``, rlhf_lab/testbed/): a tiny Llama over ``symbols`` symbols."""

    symbols: int = 4  # V: responses are trainer.max_new_tokens (T) symbols, V^T of them in all
    init_seed: int = 0  # the initial policy = the reference; fixed by the task, not by the run's seed
    init_std: float = 0.2  # initializer_range: how far from uniform the reference is
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 64
    stop: bool = False  # the last symbol ends a response (its EOS): responses of 1 to T symbols, not exactly T


@dataclass
class ExactModelConfig(ModelConfig):
    exact: ExactTaskDims = field(default_factory=ExactTaskDims)


# --------------------------------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """What every prompt source reads; ``movie_prompts`` (embedded) uses it as it is."""

    name: str = MISSING  # movie_prompts | jsonl | csv | hub | exact | reasoning_gym
    prompt_column: str = "prompt"
    train_split: str = "train"  # file stem in a data folder, or the hub split
    eval_split: str = "eval"
    eval_fraction: float = 0.0  # >0: carve eval prompts out of train when there is no eval split
    max_prompt_tokens: int = 256


@dataclass
class ReasoningGymDataConfig(DataConfig):
    """``data=reasoning_gym``: a reasoning-gym task generated offline (rlhf_lab/data/reasoning_gym.py)."""

    task: str = "basic_arithmetic"  # any registered reasoning-gym task
    size: int = 1000  # training examples
    eval_size: int = 64  # held-out examples (from task_seed + 1)
    task_seed: int = 0
    system_prompt: bool = True  # reasoning-gym's own system prompt (answer in <answer>...</answer>)


@dataclass
class DataPathConfig(DataConfig):
    """A prompt source named by ``data.path``: a local jsonl/csv file or folder, or a hub dataset id."""

    path: str | None = None


# ------------------------------------------------------------------------------------------------- logger


@dataclass
class LoggerConfig:
    """``logger=none`` uses this schema as it is: local metrics files are always written."""

    name: str = MISSING  # registered kind `logger`
    mode: str = "auto"  # rlhf_lab.trackers.wandb_run.MODES
    samples_every: int = 10  # steps between generation-sample tables
    # logger=[wandb,tensorboard]: each option adds itself here (dicts merge); rlhf_lab/trackers/multi.py
    trackers: dict[str, bool] = field(default_factory=dict)
    mlflow_tracking_uri: str | None = None  # logger=mlflow: null = $MLFLOW_TRACKING_URI, else <run folder>/mlruns
    mlflow_experiment: str | None = None  # logger=mlflow: null = experiment_name
    trackio_project: str | None = None  # logger=trackio: null = experiment_name


@dataclass
class WandbLoggerConfig(LoggerConfig):
    project: str | None = None  # null: $WANDB_PROJECT, else rlhf_lab
    log_model: bool = False  # upload the final checkpoint as a W&B model artifact
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    job_type: str | None = None  # null: the stage (train, sft, dpo, reward_model, eval)


# --------------------------------------------------------------------------------------------------- claims


@dataclass
class ClaimConfig:
    """A literature claim an experiment checks (``rlhf-lab report``; rlhf_lab/config/claims.py): arm ``a``'s
    ``metric`` (a report column) against arm ``b``'s, or against ``value``, by at least ``min_effect``."""

    name: str = MISSING  # a short identifier (W&B summary key claims/<name>/...)
    metric: str = MISSING  # a report column, e.g. final_gap (rlhf_lab/tools/report_columns.py)
    a: str = MISSING  # an arm of the sweep: its swept overrides, e.g. "kl_arm=kl_reward" or "algorithm=grpo,kl_arm=mse_loss"
    kind: str = "less"  # less (a < b) | equal (|a - b| <= min_effect) | at_most (a <= value) | at_least (a >= value)
    b: str | None = None  # the other arm (less, equal)
    value: float | None = None  # the bound (at_most, at_least); for a rate (diverged) the rate's bound in (0, 1)
    min_effect: float | None = None  # required: the smallest effect that matters, in the metric's units (equal: the margin)
    noise: float | None = None  # the sd of the per-seed numbers a pilot showed: the seeds are checked against power at launch
    text: str = ""  # the claim as its source states it


# --------------------------------------------------------------------------------------------------- root


@dataclass
class Config:
    algorithm: AlgorithmConfig = MISSING
    kl: KLConfig = MISSING
    reward: RewardConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    logger: LoggerConfig = MISSING
    hardware: HardwareConfig = MISSING
    generation: GenerationConfig = MISSING
    env: EnvConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    experiment_name: str = "default"
    experiment_time: str | None = None  # an experiment's measured wall time, printed when it is launched
    # What a run returns to a hyperparameter search (rlhf_lab/config/objective.py): null returns the summary.
    optimized_metric: str | None = None  # a summary.json key, e.g. eval/reward/mean
    kl_budget: float | None = None  # subtract kl_budget_penalty * (eval/kl/exact - kl_budget) above the budget
    kl_budget_penalty: float = 10.0
    eval: EvalConfig = field(default_factory=EvalConfig)
    plugins: list[str] = field(default_factory=list)  # modules imported before validation (rlhf_lab/app/plugins.py)
    claims: list[ClaimConfig] = field(default_factory=list)  # what an experiment's report checks (rlhf-lab report)


# group -> {schema name in the ConfigStore: dataclass}; each option's YAML names one in its defaults list.
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "algorithm": {"grpo_schema": GRPOConfig, "reinforce_schema": ReinforceConfig, "ppo_schema": PPOConfig},
    "kl": {"kl_schema": KLConfig},
    "reward": {
        "sentiment_schema": SentimentRewardConfig,
        "classifier_schema": ClassifierRewardConfig,
        "reward_model_schema": RewardModelConfig,
        "python_schema": PythonRewardConfig,
        "length_schema": LengthRewardConfig,
        "composite_schema": CompositeRewardConfig,
        "route_schema": RouteRewardConfig,
        "exact_table_schema": ExactTableRewardConfig,
        "math_verify_schema": MathVerifyRewardConfig,
        "reasoning_gym_schema": ReasoningGymRewardConfig,
        "pairwise_schema": PairwiseRewardConfig,
    },
    "model": {"model_schema": ModelConfig, "tiny_schema": TinyModelConfig, "exact_schema": ExactModelConfig},
    "data": {"data_schema": DataConfig, "data_path_schema": DataPathConfig,
             "reasoning_gym_data_schema": ReasoningGymDataConfig},
    # tensorboard/mlflow/csv name trackers_schema: the same type as wandb's, so logger=[wandb,csv] merges in any order
    "hardware": {"hardware_schema": HardwareConfig},
    "generation": {"generation_schema": GenerationConfig, "vllm_schema": VLLMGenerationConfig,
                   "vllm_server_schema": VLLMServerGenerationConfig},
    "env": ENV_SCHEMAS,
    "logger": {"logger_schema": LoggerConfig, "wandb_schema": WandbLoggerConfig, "trackers_schema": WandbLoggerConfig},
}


def register_configs() -> None:
    """Store the root schema as ``schema`` and every option schema under its group (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for group, schemas in OPTION_SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=group, name=name, node=node)
