"""Rewards, registered under kind ``reward``: score a batch of (prompt, response) pairs.

Built-ins: ``sentiment``, ``classifier``, ``reward_model``, ``python``, ``length``, ``composite``;
``rewards.base.build_reward(cfg)`` builds one by name (after ``rlhf_lab.components`` is imported).
"""
