"""Registered algorithms: importing this package registers each one."""

from rlhf_lab.algorithms import grpo, ppo, reinforce  # noqa: F401
