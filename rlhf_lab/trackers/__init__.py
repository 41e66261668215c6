"""Experiment trackers behind one interface (:class:`rlhf_lab.trackers.base.Tracker`): ``none``, ``wandb``,
``tensorboard``, ``mlflow``, ``csv``; ``logger=[wandb,tensorboard]`` runs several (:mod:`.multi`).

Local JSON Lines files (``metrics.jsonl``, ``samples.jsonl``) are always written, whatever the tracker.
"""
