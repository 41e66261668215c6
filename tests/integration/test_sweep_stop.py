"""A sweep stopped by SIGINT and resumed by one command (rlhf_lab/app/sweep_watch.py), on the joblib launcher: the
signal sent to the sweep's process alone (as a scheduler or a wrapper sends it) and to its whole process group (as a
terminal's Ctrl-C) stops each running job with its checkpoint, no further job starts, the sweep says how many of each
and prints the one command that resumes it; that command finishes every job, and run again runs none.

Real ``python -m rlhf_lab -m`` processes on the tiny model, two jobs at a time.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_resume import environment, read_records
from tests.limits import HANG_GUARD_S

STEPS = 60
SWEEP = ["model=tiny", f"trainer.steps={STEPS}", "trainer.prompts_per_step=2", "algorithm.group_size=2",
         "trainer.max_new_tokens=4", "trainer.eval_prompts=0", "trainer.progress_bar=false", "trainer.num_threads=1",
         "logger=none", "hydra/launcher=joblib_local", "hydra.launcher.n_jobs=2", "seed=0,1,2"]


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """The command in a session of its own (no terminal's signals), SIGINT at its default (not ignored)."""
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environment(), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_until_training(folders: list[Path], process: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "the sweep ended before its jobs trained"
        if all(any("reward/mean" in r for r in read_records(f / "metrics.jsonl")) for f in folders):
            return
        time.sleep(0.05)
    process.kill()
    pytest.fail("the jobs did not start training")


@pytest.mark.parametrize("target", ["process", "group"])
def test_sigint_stops_the_sweep_with_checkpoints_and_one_command_resumes_it(tmp_path: Path, target: str) -> None:
    folder = tmp_path / "sweep"
    command = [sys.executable, "-m", "rlhf_lab", "-m", *SWEEP, f"hydra.sweep.dir={folder}"]
    sweep = launch(command, tmp_path / "stop.log")
    wait_until_training([folder / "0_seed=0", folder / "1_seed=1"], sweep)
    if target == "process":  # kill -INT PID
        sweep.send_signal(signal.SIGINT)
    else:  # a terminal's Ctrl-C: the whole process group
        os.killpg(sweep.pid, signal.SIGINT)
    assert sweep.wait(timeout=HANG_GUARD_S) == 130
    output = (tmp_path / "stop.log").read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "received SIGINT: each running job finishes its step and writes a checkpoint" in output
    assert output.count("stopped after step ") == 2 and "abort" not in output.split("sweep stopped")[0].split(
        "(send it again to abort without one)")[-1]
    assert f"not started: the sweep was stopped by SIGINT ({folder / '2_seed=2'})" in output
    assert "sweep stopped by SIGINT: 0 jobs finished, 2 stopped with a checkpoint, 1 never started" in output
    for job in ("0_seed=0", "1_seed=1"):
        assert (folder / job / "checkpoints" / "latest").exists()
    assert not (folder / ".sweep_stopped").exists()
    line = next(line for line in output.splitlines() if line.startswith("to resume the sweep, run: "))
    resume = shlex.split(line.removeprefix("to resume the sweep, run: "))
    assert resume[-2:] == ["trainer.resume=auto", f"hydra.sweep.dir='{folder}'"]

    rerun = launch([sys.executable, "-m", "rlhf_lab", *resume[resume.index("rlhf_lab") + 1:]], tmp_path / "resume.log")
    assert rerun.wait(timeout=HANG_GUARD_S) == 0, (tmp_path / "resume.log").read_text()
    output = (tmp_path / "resume.log").read_text()
    assert output.count("resumed from ") == 2 and "Traceback" not in output
    for job in ("0_seed=0", "1_seed=1", "2_seed=2"):
        assert json.loads((folder / job / "summary.json").read_text())["steps"] == STEPS
    assert "sweep: 3/3 jobs done" in output and "left" in output  # the progress as jobs end

    again = launch([sys.executable, "-m", "rlhf_lab", *resume[resume.index("rlhf_lab") + 1:]], tmp_path / "again.log")
    assert again.wait(timeout=HANG_GUARD_S) == 0
    output = (tmp_path / "again.log").read_text()
    assert output.count("already finished: ") == 3 and "resumed from" not in output
