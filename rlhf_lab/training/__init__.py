"""The training path, split along its seams.

- ``experience``: prompts -> generate -> score -> reference -> per-token KL terms -> a ``Rollout``;
- ``update``: the ``Updater`` (parameter groups, optimizer, schedule, epochs / mini / micro-batches, skips);
- ``records``: step timer, metrics and samples files, summary;
- ``checkpoint``: crash-safe checkpoints and resume;
- ``loop``: the ``Trainer`` that builds the parts and runs steps, evaluation and signals;
- ``run``: :func:`run`, what the CLI and the API call (the algorithm's loop class, under the run folder's lock).
"""

from rlhf_lab.training.loop import Trainer
from rlhf_lab.training.run import run

__all__ = ["Trainer", "run"]
