"""Experiment trackers behind one interface (:class:`rlhf_lab.trackers.base.Tracker`): ``none`` and ``wandb``.

Local JSON Lines files (``metrics.jsonl``, ``samples.jsonl``) are always written, whatever the tracker.
"""
