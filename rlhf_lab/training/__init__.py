"""The run: what repeats the RL step (:mod:`rlhf_lab.step`) and keeps its state, split along its seams.

- ``records``: metrics and samples files, summary (the step timer is :mod:`rlhf_lab.runtime.timer`);
- ``run_state``, ``stop``, ``run_eval``, ``step_record``: the ``Trainer``'s resume and checkpoints, stop signals,
  evaluation and record of a step;
- ``checkpoint``: crash-safe checkpoints and resume;
- ``loop``: the ``Trainer`` that builds the parts and runs steps, evaluation and signals;
- ``launch``: :func:`run`, what the CLI and the API call (the algorithm's loop class, under the run folder's lock).

``Trainer`` and ``run`` load on first use, so importing one unit (``rlhf_lab.training.evaluation``) does not
import the whole loop.
"""

from typing import Any

__all__ = ["Trainer", "run"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from rlhf_lab.training.loop import Trainer

        return Trainer
    if name == "run":
        from rlhf_lab.training.launch import run

        return run
    raise AttributeError(f"module 'rlhf_lab.training' has no attribute {name!r}")
