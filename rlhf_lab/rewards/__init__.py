"""Rewards, registered under kind ``reward``: score a batch of (prompt, response) pairs.

Importing this package registers every built-in reward (``sentiment``, ``classifier``,
``reward_model``, ``python``, ``length``, ``composite``); ``build_reward(cfg)`` builds one by name.
"""

from rlhf_lab.rewards import classifier, composite, length, python_function, reward_model, sentiment
from rlhf_lab.rewards.base import Reward, RewardOutput, build_reward
from rlhf_lab.rewards.reward_model import train_reward_model

__all__ = [
    "Reward",
    "RewardOutput",
    "build_reward",
    "classifier",
    "composite",
    "length",
    "python_function",
    "reward_model",
    "sentiment",
    "train_reward_model",
]
