"""The RL step: what one step of an online algorithm does, apart from the run that repeats it.

- ``experience``: prompts -> generate -> score -> reference -> per-token KL terms -> a ``Rollout``;
- ``scoring_pass``: the trainer's own pass over a batch (π_old, the entropy, PPO's values) and when it runs;
- ``sampling``: DAPO's sampling rules (overlong shaping, dynamic sampling);
- ``update``: the ``Updater`` (parameter groups, optimizer, schedule, epochs / mini / micro-batches, skips);
- ``step_metrics``: a step's metrics over every rank's samples;
- ``ahead``: each step's prompts and the batch generated one step ahead;
- ``compute``: how the passes are computed (LM-head chunking, token budget, packing).

The run that repeats the step (loop, checkpoints, resume, lock, records, budget, evaluation) is
:mod:`rlhf_lab.training`; nothing here imports it.
"""
