"""Schemas of the offline stages (``algorithm=sft|reward_model|dpo``) and their data (``data=preferences|
demonstrations|embedded_preferences``), added to :data:`rlhf_lab.config.schema.OPTION_SCHEMAS`.

The stage schemas subclass :class:`AlgorithmConfig` so the root config types them like any algorithm; the
fields that steer sampled rollouts (advantage, clipping, epochs) do not apply to them and are not checked.
``algorithm.group_size`` is not read: an example is one row (a demonstration) or two (a pair).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_lab.config.schema import OPTION_SCHEMAS, AlgorithmConfig, DataPathConfig


@dataclass
class OfflineAlgorithmConfig(AlgorithmConfig):
    """What every offline stage reads; batches are ``trainer.prompts_per_step`` examples."""

    advantage: str = ""  # none: the stages learn from data
    export: str = "merged"  # the final model/ folder under LoRA: merged (full weights) | adapter


@dataclass
class SFTConfig(OfflineAlgorithmConfig):
    """Supervised fine-tuning on demonstrations: token-mean NLL of the response tokens (EOS included)."""

    packing: bool = False  # pack each step's demonstrations into rows, no cross-contamination (offline/packing.py)
    packing_length: int | None = None  # tokens per packed row; null: data.max_prompt_tokens + max_response_tokens


@dataclass
class DPOConfig(OfflineAlgorithmConfig):
    """DPO and its variants on preference pairs against the initial model (adapter off under LoRA)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"  # registered kind `preference_loss`: sigmoid | ipo | hinge | robust | simpo
    label_smoothing: float = 0.0  # sigmoid, simpo: cDPO's ε; robust: the label-noise rate ε (< 0.5)
    gamma: float = 0.5  # simpo: the target reward margin γ
    ipo_normalize: str = "sum"  # ipo: sum (the paper's eq. 17) | mean (per-token log-ratios, TRL's)
    nll_weight: float = 0.0  # + α · the chosen response's mean token NLL (SimPO's sft_weight, TRL's cpo/rpo_alpha)


@dataclass
class RewardModelTrainingConfig(OfflineAlgorithmConfig):
    """A scalar reward model (sequence-classification head on ``model=``'s causal LM) fit by Bradley–Terry."""

    pooling: str = "last"  # rlhf_lab.offline.reward_model.POOLINGS: last (non-pad token) | mean
    center_rewards_coefficient: float = 0.0  # c · (r_w + r_l)² keeps rewards centred (TRL's name)
    use_margin: bool = True  # subtract data.margin_column's value inside the sigmoid when the data has one
    max_length: int = 512  # tokens of prompt + response, cut from the left


@dataclass
class OfflineDataConfig(DataPathConfig):
    """A local jsonl/csv file or folder (train.* / eval.*) or a hub dataset of examples."""

    format: str = "auto"  # auto | jsonl | csv | hub (auto: by the path's suffix or folder; else a hub id)
    on_invalid: str = "drop"  # drop | error: an empty or identical pair / empty demonstration
    eval_fraction: float = 0.1
    max_response_tokens: int = 256  # longer responses are cut (and then carry no EOS)


@dataclass
class PreferenceDataConfig(OfflineDataConfig):
    """(prompt, chosen, rejected) pairs, plain text or chat messages (TRL's conversational format)."""

    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    margin_column: str | None = None  # optional per-pair margin / score gap (reward-model training)


@dataclass
class DemonstrationDataConfig(OfflineDataConfig):
    """Demonstrations: (prompt, response) columns, or one column of chat messages ending with the reply."""

    response_column: str = "response"
    messages_column: str = "messages"  # used when the rows have it (and no response column)


@dataclass
class EmbeddedPreferenceConfig(PreferenceDataConfig):
    """Pairs built offline from the embedded prompts: ``samples_per_prompt`` responses of ``model=``, scored
    by the ``gold`` reward; best and worst kept when their gap exceeds ``min_gap`` (rlhf_lab/offline/builder.py)."""

    prompts: str = "movie_prompts"  # the embedded prompt set
    max_prompts: int = 0  # 0: every prompt
    samples_per_prompt: int = 4
    min_gap: float = 0.1
    gold: dict[str, Any] = field(default_factory=lambda: {"name": "sentiment"})  # a reward config (VADER)
    max_new_tokens: int = 32
    temperature: float = 1.0
    batch_prompts: int = 8  # prompts generated at once
    margin_column: str | None = "margin"  # the gold gap, written with each pair


OPTION_SCHEMAS["algorithm"].update({"sft_schema": SFTConfig, "dpo_schema": DPOConfig,
                                    "reward_model_schema": RewardModelTrainingConfig})
OPTION_SCHEMAS["data"].update({"preferences_schema": PreferenceDataConfig,
                               "demonstrations_schema": DemonstrationDataConfig,
                               "embedded_preferences_schema": EmbeddedPreferenceConfig})
