"""``rlhf-lab launch``: torch's launcher around the run. A user error in a multi-process launch ends with rank 0's
one line alone; another failure with one line of the launcher's (no traceback, no "Root Cause" box either way); the
exit status is the failed rank's; a mistake in the launcher's own arguments is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_multiprocess import TIMEOUT, environment

from rlhf_lab.app.launch import failure_line, parse

HINT = "; give torchrun's options first, then the run's overrides (Hydra's flags after --)"


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_lab", "launch", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT, env=environment())


def test_a_user_error_in_two_processes_is_rank_zeros_one_line(tmp_path: Path) -> None:
    """Both gloo ranks compose ``kl=nope``; rank 0 prints the error, the agent stops rank 1: one line in all (blank
    lines aside), exit status 2."""
    result = launch(tmp_path, "--nproc-per-node", "2", "model=tiny", "kl=nope", f"trainer.output_dir={tmp_path / 'run'}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: kl='nope' is not an option; "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


@pytest.mark.parametrize(("args", "overrides"), [
    (["--nproc-per-node", "2"], []),
    (["--nproc_per_node=2", "model=tiny", "-m", "kl=k3,kl"], ["model=tiny", "-m", "kl=k3,kl"]),
    (["--nproc-per-node", "2", "--", "--cfg", "job"], ["--cfg", "job"]),
], ids=["no_overrides", "overrides_after_the_options", "after_double_dash"])
def test_the_overrides_follow_torchruns_options(args: list[str], overrides: list[str]) -> None:
    launch = parse(args)
    assert (launch.nproc_per_node, launch.module, launch.training_script) == ("2", True, "rlhf_lab")
    assert launch.training_script_args == overrides


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc-per-node", "2", "--bogus", "model=tiny"], "unrecognized arguments: --bogus" + HINT),
    (["--nproc-per-node"], "--nproc-per-node needs a value" + HINT),
    (["--nproc-per-node", "2", "-m", "kl=k3,kl"], "-m/--module is torchrun's, not an option here: this command runs "
     "-m rlhf_lab itself (Hydra's -m goes after --: rlhf-lab launch --nproc-per-node 2 -- -m KEY=A,B)"),
], ids=["unknown_option", "missing_value", "module_flag"])
def test_a_mistake_in_the_launchers_arguments_is_one_line(run_cli, args: list[str], message: str) -> None:
    code, printed, err = run_cli(["launch", *args])
    assert (code, printed, err) == (2, "", f"error: rlhf-lab launch: {message}\n")


def test_a_value_torchrun_refuses_is_one_line(tmp_path: Path) -> None:
    """torchrun checks ``--nproc-per-node``'s value when it builds the launch (a ValueError): one line too."""
    result = launch(tmp_path, "--nproc-per-node", "many", "model=tiny")
    assert (result.returncode, result.stderr) == (2, "error: rlhf-lab launch: Unsupported nproc_per_node value: many\n")


def test_help_is_torchruns_options_under_this_command(run_cli) -> None:
    code, printed, _ = run_cli(["launch", "--help"])
    assert code == 0 and printed.startswith("usage: rlhf-lab launch [torchrun options] [--] [KEY=VALUE ...]")
    assert "--nproc-per-node" in printed and "--standalone" in printed


def failed(**exitcodes: int) -> dict[int, SimpleNamespace]:
    return {int(rank[1:]): SimpleNamespace(exitcode=code) for rank, code in exitcodes.items()}


@pytest.mark.parametrize(("failures", "first", "line", "status"), [
    (failed(r0=-9, r1=-15), 0, "rank 0 died by signal SIGKILL (9), and the launcher stopped rank 1", 137),
    (failed(r0=143, r1=143), 1, "ranks 0-1 exited with status 143; the output above from ranks 0-1 says why", 143),
    (failed(r0=2, r1=1, r2=-15, r3=-11, r4=-9), 1,
     "rank 1 exited with status 1, rank 0 exited with status 2, rank 3 died by signal SIGSEGV (11), and the launcher "
     "stopped ranks 2, 4; the output above from ranks 0-1 says why", 1),
], ids=["killed", "stopped_together", "mixed"])
def test_the_line_names_each_failed_rank_and_the_first_rank_s_status_is_the_exit(failures, first: int, line: str,
                                                                                 status: int) -> None:
    assert failure_line(failures, first) == (f"rlhf-lab launch: {line}", status)
