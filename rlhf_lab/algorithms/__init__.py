"""Registered algorithms: importing this package registers each one."""

from rlhf_lab.algorithms import grpo, reinforce  # noqa: F401
