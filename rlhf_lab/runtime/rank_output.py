"""What the ranks of a torchrun launch print when the run ends early: one line from rank 0, not one per rank.

An error every rank finds alike (a config or data mistake) is printed by rank 0 alone; a rank's own error (a reward
that failed on its samples) by that rank; how a run stopped by a signal ended, by rank 0. A quiet rank waits for
rank 0 to exit first: ``torchrun`` stops every rank once one exits, and rank 0 must not be stopped before it has
spoken. Outside a torchrun launch every process prints its own lines.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import suppress
from datetime import timedelta

import torch.distributed as dist

from rlhf_lab.runtime.distributed import is_distributed, launched_processes

ERROR_WAIT_S = 5.0  # how long a non-zero rank waits for rank 0 to report how the run ended
_RANK_ZERO_SAID = "rlhf_lab/rank_0_said"


def launch_rank() -> int:
    """This process's rank in a torchrun launch of several processes, known before the process group exists (its
    ``RANK``); 0 otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or launched_processes() < 2:
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report_error(line: str) -> None:
    """Print a user error's one line on stderr once per run, not once per rank.

    Rank 0 prints it. Another rank of a torchrun launch prints its line only when it is its own: after the process
    group exists, when rank 0 did not report the same line within ``ERROR_WAIT_S`` (a reward that failed on this
    rank's samples only); before it, when rank 0 did not end the launch within ``ERROR_WAIT_S`` (every rank composed
    and checked the same command line and files, so rank 0 normally reports the same line and exits, and torchrun
    then stops the others). A rank that stays quiet waits for that, so rank 0 is never stopped before it has
    spoken."""
    if launch_rank() == 0:
        _say_as_rank_zero(line)
    elif not is_distributed():
        _outlive_rank_zero()
        print(line, file=sys.stderr, flush=True)
    elif _rank_zero_said() == line:
        _outlive_rank_zero()
    else:
        print(line, file=sys.stderr, flush=True)


def report_stop(text: str) -> None:
    """Print how a run that every rank stopped together ended (:class:`~rlhf_lab.errors.TrainingStopped`): rank 0
    says it; another rank says nothing and waits for rank 0 to say it and exit (see :func:`report_error`)."""
    if launch_rank() == 0:
        _say_as_rank_zero(text)
    elif is_distributed():
        _rank_zero_said()
        _outlive_rank_zero()


def _outlive_rank_zero() -> None:
    """Wait up to ``ERROR_WAIT_S`` for the launcher to stop this rank, which it does once rank 0 has exited: rank 0
    ends first, its last lines printed and its files closed."""
    time.sleep(ERROR_WAIT_S)


def _say_as_rank_zero(text: str) -> None:
    """Print ``text``, then leave it in the process group's store for the other ranks (:func:`_rank_zero_said`)."""
    print(text, file=sys.stderr, flush=True)
    if is_distributed():
        with suppress(dist.DistError, RuntimeError):  # the launcher's store is gone: nobody waits for it
            dist.distributed_c10d._get_default_store().set(_RANK_ZERO_SAID, text)


def _rank_zero_said() -> str | None:
    """What rank 0 printed, waiting for it up to ``ERROR_WAIT_S``; None if it printed nothing by then."""
    store = dist.distributed_c10d._get_default_store()
    try:
        store.wait([_RANK_ZERO_SAID], timedelta(seconds=ERROR_WAIT_S))
        return store.get(_RANK_ZERO_SAID).decode("utf-8", "replace")
    except (dist.DistError, RuntimeError):
        return None
