"""``rlhf-lab launch [torchrun options] [--] [KEY=VALUE ...]``: ``torchrun ... -m rlhf_lab`` with one line on failure.

torch's own launcher starts the run: ``torch.distributed.run``'s argument parser and its ``run``. ``run`` starts the
elastic agent (``elastic_launch``), which starts the ranks. The difference is how a failed run ends. Plain
``torchrun`` lets the agent's ``ChildFailedError`` escape, so after the ranks' own lines (rank 0's ``error: ...``)
it prints the agent's traceback and a "Root Cause" box. Here the error is caught. A user error (status 2) ends with
rank 0's own line alone; any other failure with one line of the launcher's: which ranks failed, with which status or
signal. The launch then exits with the first failed rank's status (2 for a user
error, 128 + N for a rank killed by signal N). The agent's log lines about each rank's exit (logger
``torch.distributed.elastic.multiprocessing``, which ``LOGLEVEL`` does not reach) are what the one line replaces, so
that logger is set to CRITICAL. ``RLHF_LAB_TRACEBACK=1`` keeps both, as plain ``torchrun`` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
from typing import Any, NoReturn

MODULE = "rlhf_lab"
PROG = "rlhf-lab launch"
USAGE = f"{PROG} [torchrun options] [--] [KEY=VALUE ...]"
DESCRIPTION = (f"One run on N processes: torchrun -m {MODULE} (torch's elastic launcher), ending a failed run with one "
               "line instead of torch's traceback. torchrun's options come first, then the run's overrides (Hydra's "
               "flags such as -m or --cfg after --).")
EPILOG = (f"training_script is {MODULE} (given by this command), followed by the overrides. Example: {PROG} "
          "--nproc-per-node 2 model=tiny trainer.strategy=ddp. On failure the ranks' own lines come first, then "
          "one line naming the failed ranks; the exit status is the first failed rank's (2: a user error). "
          "RLHF_LAB_TRACEBACK=1 prints torch's report instead, as plain torchrun does.")
PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing"  # the agent's lines on each rank's exit and stop
USER_ERROR = 2  # the status of a run stopped by a mistake in its config or data (rank 0 printed the one line)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL)  # what the agent sends the other ranks once one has failed


def main(args: list[str]) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    launch = parse(args)
    torch_report = os.environ.get("RLHF_LAB_TRACEBACK", "") not in ("", "0")
    if not torch_report:
        logging.getLogger(PROCESS_LOGGER).setLevel(logging.CRITICAL)  # "failed (exitcode: 2) local_rank: 0 ..."
    try:
        run(launch)
    except ChildFailedError as failed:
        if torch_report:
            raise
        line, status = failure_line(failed.failures, failed.get_first_failure()[0])
        if status != USER_ERROR:  # a user error's one line is rank 0's own, already printed: nothing to add
            print(line, file=sys.stderr, flush=True)
        sys.exit(status)
    except SignalException as stop:  # the agent itself got the signal, and passed it on to the ranks
        if torch_report:
            raise
        print(f"{PROG}: stopped by {signal_name(int(stop.sigval))}, which the launcher passed to every rank",
              file=sys.stderr, flush=True)
        sys.exit(128 + int(stop.sigval))
    except ValueError as error:  # torchrun's check of an option's value, e.g. --nproc-per-node=many
        if torch_report:
            raise
        refuse(str(error))


def parse(args: list[str]) -> argparse.Namespace:
    """torchrun's options and the run's overrides, read by torchrun's own parser as ``[options] -m rlhf_lab [overrides]``.

    That parser takes the first argument that is not an option (or the first after ``--``) as the script and the
    rest as the script's arguments. ``rlhf_lab`` appended at the end makes that split whether or not overrides were
    given; it is then dropped from them, and ``rlhf_lab`` becomes the module to run.
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog, parser.usage, parser.description, parser.epilog = PROG, USAGE, DESCRIPTION, EPILOG
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):  # argparse's usage and error: replaced by one line
            launch = parser.parse_args([*args, MODULE])
    except SystemExit as stop:
        if not stop.code:  # --help
            raise
        lines = captured.getvalue().strip().splitlines() or [f"{PROG}: error: invalid arguments"]
        message = lines[-1].removeprefix(f"{PROG}: error: ")
        if "training_script" in message:  # the last option took the appended module as its value
            message = f"{args[-1]} needs a value"
        refuse(f"{message}; give torchrun's options first, then the run's overrides (Hydra's flags after --)")
    taken = [flag for flag, given in (("-m/--module", launch.module), ("--no-python", launch.no_python),
                                      ("--run-path", launch.run_path)) if given]
    if taken:
        refuse(f"{taken[0]} is torchrun's, not an option here: this command runs -m {MODULE} itself (Hydra's -m "
               f"goes after --: {PROG} --nproc-per-node 2 -- -m KEY=A,B)")
    overrides = [launch.training_script, *launch.training_script_args][:-1]
    launch.training_script, launch.training_script_args, launch.module = MODULE, overrides, True
    return launch


def failure_line(failures: dict[int, Any], first: int) -> tuple[str, int]:
    """The line that ends a failed launch, and its exit status.

    ``failures`` maps each failed rank to torch's ``ProcessFailure`` (its ``exitcode``: the status, or -N for signal
    N); ``first`` is the rank that failed first. The status is that rank's own, or 128 + N when signal N killed it.
    Ranks killed by SIGTERM or SIGKILL after it are named as stopped by the launcher, which does that to the
    others once one rank has failed.
    """
    stopped = sorted(rank for rank, failure in failures.items()
                     if rank != first and -failure.exitcode in STOP_SIGNALS)
    ended: dict[str, list[int]] = {}  # how they ended -> ranks, the first failed rank's way first
    for rank in sorted(failures, key=lambda rank: (rank != first, rank)):
        if rank not in stopped:
            ended.setdefault(how_it_ended(failures[rank].exitcode), []).append(rank)
    line = f"{PROG}: " + ", ".join(f"{rank_list(ranks)} {how}" for how, ranks in ended.items())
    if stopped:
        line += f", and the launcher stopped {rank_list(stopped)}"
    speakers = [rank for rank in failures if rank not in stopped and failures[rank].exitcode > 0]
    if speakers:
        line += f"; the output above from {rank_list(speakers)} says why"
    status = failures[first].exitcode
    return line, status if status > 0 else 128 - status


def how_it_ended(exitcode: int) -> str:
    return f"exited with status {exitcode}" if exitcode >= 0 else f"died by signal {signal_name(-exitcode)}"


def rank_list(ranks: list[int]) -> str:
    """``rank 0``; ``ranks 0-3, 6``: consecutive ranks as one span."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(low) if low == high else f"{low}-{high}" for low, high in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return str(number)


def refuse(message: str) -> NoReturn:
    print(f"error: {PROG}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
