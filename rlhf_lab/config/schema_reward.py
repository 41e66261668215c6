"""Structured configs of the ``reward`` group: the base every reward's options share, and one dataclass per built-in
reward (see :mod:`rlhf_lab.config.schema` for how Hydra stores them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class RewardConfig:
    name: str = MISSING  # registered kind `reward`
    on_nonfinite: str = "error"  # error | drop: a NaN/inf score stops the run or drops that sample
    rescale: str = "none"  # registered kind `reward_rescale`: none | mode_anchor (arXiv 2510.20817), training only
    rescale_threshold: float | None = None  # mode_anchor: scores >= this count as high-reward modes
    rescale_anchor: str = "batch"  # mode_anchor: batch (one anchor over the batch, the paper's) | group (one per prompt)


@dataclass
class SentimentRewardConfig(RewardConfig):
    target: str = "positive"  # rlhf_lab.rewards.sentiment.TARGETS


@dataclass
class ClassifierRewardConfig(RewardConfig):
    model_path: str | None = None  # folder or hub id of an AutoModelForSequenceClassification
    label: Any = None  # label name or index
    output: str = "logit"  # rlhf_lab.rewards.classifier.OUTPUTS
    include_prompt: bool = False
    separator: str = " "  # between prompt and response when include_prompt
    batch_size: int = 32
    max_length: int = 512


@dataclass
class RewardModelConfig(RewardConfig):
    model_path: str | None = None  # a trained scalar reward model's folder or hub id
    normalize: bool = False
    mean: float = 0.0
    std: float = 1.0
    batch_size: int = 32
    max_length: int = 512


@dataclass
class PythonRewardConfig(RewardConfig):
    function: str | None = None  # module:function
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class MathVerifyRewardConfig(RewardConfig):
    answer_column: str = "answer"  # the data column holding each prompt's ground-truth answer


@dataclass
class ReasoningGymRewardConfig(RewardConfig):
    tag: str = "answer"  # the response's answer is inside <tag>...</tag>


@dataclass
class PairwiseRewardConfig(RewardConfig):
    judge: str | None = None  # module:function, judge(prompt, a, b) -> P(a better than b)
    base: Any = None  # or a reward config ({name: ..., its fields}) compared by Bradley-Terry
    temperature: float = 1.0  # Bradley-Terry scale: P(a > b) = sigmoid((r_a - r_b) / temperature)


@dataclass
class LengthRewardConfig(RewardConfig):
    min_words: int = 10
    max_words: int = 60
    slope_words: float = 20.0
    require_terminal_punctuation: bool = False
    format_weight: float = 0.5  # size of the terminal-punctuation bonus/penalty (with require_terminal_punctuation)


@dataclass
class ExactTableRewardConfig(RewardConfig):
    """A seeded reward table over all V^T responses of the exact task (rlhf_lab/rewards/exact_table.py)."""

    symbols: int = 4  # V; conf/reward/exact_table.yaml reads it from model.exact.symbols
    length: int = 4  # T; conf/reward/exact_table.yaml reads it from trainer.max_new_tokens
    seed: int = 0  # the table's seed (the task, not the run)
    peaks: int = 3  # high-reward sequences: the k-th (k = 0, 1, ...) scores peak_reward·(1 − k/peaks)
    peak_reward: float = 1.0
    noise: float = 0.3  # every sequence also scores noise·u, u ~ U[0, 1)
    modes: int = 0  # M >= 2: the first M peaks score exactly peak_reward, equally rewarded optimal modes (0: off)
    stop: bool = False  # responses end at the last symbol (1 to T symbols); conf/reward/exact_table.yaml follows model


@dataclass
class CompositeRewardConfig(RewardConfig):
    components: list[Any] = field(default_factory=list)  # [{name, weight, key, <that reward's fields>}]


@dataclass
class RouteRewardConfig(RewardConfig):
    by: str = "data_source"  # the data column whose value names each row's reward
    rewards: Any = None  # {column value: {name, <that reward's fields>}} (a mapping; null until set)
    default: Any = None  # the reward config of rows whose value is not routed; null: an error
