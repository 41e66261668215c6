"""One writer per run folder: a second process on a folder in use stops at start with one line naming the
holder's PID, the first goes on unaffected, and a SIGKILLed holder's lock is taken over by the next run.

The two-process test runs real ``python -m rlhf_lab`` processes on the tiny model; the rest is in-process.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bad_inputs import environment
from test_resume import TINY, Run

from rlhf_lab.training import run_lock
from rlhf_lab.training.checkpoint import latest_checkpoint
from tests.limits import HANG_GUARD_S


def command(run_dir: Path, *overrides: str) -> list[str]:
    """``python -m rlhf_lab`` on the tiny model into ``run_dir``; ``overrides`` replace TINY's keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    tiny = [o for o in TINY if o.split("=", 1)[0] not in keys]
    return [sys.executable, "-m", "rlhf_lab", *tiny, *overrides, f"trainer.output_dir={run_dir}"]


def test_a_held_lock_names_its_holder_and_a_dead_holders_lock_is_taken_over(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = os.open(run_dir / run_lock.LOCK_FILE, os.O_RDWR | os.O_CREAT)  # another holder, PID 4242
    os.write(other, b"4242\n")
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(run_lock.RunFolderInUse) as raised:
        run_lock.acquire(run_dir)
    assert str(raised.value) == (
        f"run folder {str(run_dir)!r} is in use by process 4242 (lock {run_dir / run_lock.LOCK_FILE}); wait for it "
        "to end or choose another trainer.output_dir"
    )
    os.close(other)  # what the kernel does when the holder dies, SIGKILL included: its PID stays in the file
    run_lock.acquire(run_dir)
    try:
        assert capsys.readouterr().err == (
            f"note: the last run in {run_dir} (process 4242) ended without releasing its lock (killed?); taking "
            "the folder over\n"
        )
        assert (run_dir / run_lock.LOCK_FILE).read_text() == f"{os.getpid()}\n"
        run_lock.acquire(run_dir)  # the same process again (the CLI, then the job): counted
        run_lock.release(run_dir)
        assert run_lock.holds(run_dir)
    finally:
        run_lock.release(run_dir)
    assert not run_lock.holds(run_dir)
    assert (run_dir / run_lock.LOCK_FILE).read_text() == ""  # a clean release leaves no PID behind


def test_the_output_folder_is_checked_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(run_lock.ConfigError, match="is a file, not a folder"):
        run_lock.check_writable(tmp_path / "file")
    with pytest.raises(run_lock.ConfigError, match="cannot be created: .* is a file"):
        run_lock.check_writable(tmp_path / "file" / "run")
    run_lock.check_writable(tmp_path / "new" / "run")  # a folder that does not exist yet, in a writable one
    first, second = run_lock.new_run_folder(tmp_path / "outputs"), run_lock.new_run_folder(tmp_path / "outputs")
    assert first != second and first.is_dir() and second.is_dir()  # runs in the same second: one folder each


def test_a_second_process_is_refused_and_a_killed_holders_folder_is_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = Run(tmp_path, run_dir, command=command(run_dir, "trainer.steps=500", "trainer.checkpoint_every=2"))
    deadline = time.monotonic() + HANG_GUARD_S
    while latest_checkpoint(run_dir / "checkpoints") is None:
        assert first.process.poll() is None, first.output
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert (run_dir / run_lock.LOCK_FILE).read_text() == f"{first.process.pid}\n"
    overrides_before = (run_dir / ".hydra" / "overrides.yaml").read_text()

    second = subprocess.run(command(run_dir, "trainer.resume=auto"), cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, env=environment())
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stderr == (
        f"error: run folder {str(run_dir)!r} is in use by process {first.process.pid} (lock "
        f"{run_dir / run_lock.LOCK_FILE}); wait for it to end or choose another trainer.output_dir\n"
    )
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == overrides_before  # Hydra never started there

    # The first run is unaffected: still training, each step once.
    steps_then = len((run_dir / "metrics.jsonl").read_text().splitlines())
    while len((run_dir / "metrics.jsonl").read_text().splitlines()) <= steps_then + 1:
        assert first.process.poll() is None, first.output
        time.sleep(0.1)
    first.process.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    step = int(checkpoint.name.split("_")[1]) - 1  # the last step it holds: step_N holds steps 0..N-1

    third = Run(tmp_path, run_dir, command=command(run_dir, f"trainer.steps={step + 2}", "trainer.checkpoint_every=2",
                                                   "trainer.resume=auto"))
    assert third.wait() == 0, third.output
    assert (f"note: the last run in {run_dir} (process {first.process.pid}) ended without releasing its lock "
            "(killed?); taking the folder over") in third.output
    assert f"resumed from {checkpoint} at step {step + 1}" in third.output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records if "reward/mean" in record]
    assert steps == list(range(step + 2))  # nothing twice, nothing missing
    segments = sorted(p.name for p in (run_dir / ".hydra" / "segments").iterdir())
    assert segments == ["from_step_0", f"from_step_{step + 1}"]
