"""Faults of a multi-process run: a signal to one rank, stale launcher variables, a user error under torchrun, a
second launch into a live run folder. Each ends in seconds, in one line from rank 0, with nothing of the run lost.

The runs are real ``torchrun`` launches of two gloo ranks on the tiny model (``test_multiprocess.py``'s helpers).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multiprocess import TIMEOUT, command, environment, metrics

from rlhf_lab.app import cli
from tests.limits import HANG_GUARD_S

QUICK = ["trainer.eval_prompts=0"]


def start(run: Path, *overrides: str) -> subprocess.Popen:
    """A 2-rank run in the background, once it has logged its first step."""
    process = subprocess.Popen(command(2, *QUICK, *overrides, f"trainer.output_dir={run}"), cwd=run.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    deadline = time.monotonic() + TIMEOUT
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.1)
    return process


def rank_pid(launcher: int, rank: int) -> int:
    """The PID of torchrun's child that runs ``rank`` (read from /proc: its children and their environment)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for child in map(int, children):
        variables = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in variables:
            return child
    raise AssertionError(f"no child of {launcher} runs rank {rank}: {children}")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    """A scheduler may signal one process of a launch. The ranks agree on the stop at the step's end: both
    checkpoint and exit (143) within seconds, rank 0 saying which rank was signalled, and the run resumes."""
    run = tmp_path / "run"
    run.mkdir()
    process = start(run, "trainer.steps=60")
    os.kill(rank_pid(process.pid, 1), signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT)  # a rank left waiting would hang past the guard
    stops = re.findall(r"^stopped after step (\d+): rank 1 received SIGTERM; checkpoint", stderr, re.MULTILINE)
    assert len(stops) == 1, stderr[-3000:]
    assert "exitcode  : 143" in stderr  # every rank's status: stopped by SIGTERM after writing the checkpoint
    last = int(stops[0])
    assert last < 59 and [line["step"] for line in metrics(run)] == list(range(last + 1))

    subprocess.run(command(2, *QUICK, f"trainer.steps={last + 3}", "trainer.resume=auto", f"trainer.output_dir={run}"),
                   cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=environment(), check=True)
    assert [line["step"] for line in metrics(run) if "reward/mean" in line] == list(range(last + 3))


def test_a_second_launch_into_a_live_run_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    """Rank 0 of the second launch finds the folder's lock held and says so once; its rank 1, which takes no lock,
    writes nothing there either (Hydra's record of the live run stays as it was)."""
    run = tmp_path / "run"
    run.mkdir()
    live = start(run, "trainer.steps=400")
    holder = rank_pid(live.pid, 0)
    record = {path.name: path.read_text() for path in (run / ".hydra").glob("*.yaml")}
    try:
        second = subprocess.run(command(2, *QUICK, "trainer.steps=3", "seed=5", f"trainer.output_dir={run}"),
                                cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=environment())
        assert live.poll() is None  # the live run goes on
    finally:
        live.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks: they checkpoint and stop
        live.communicate(timeout=TIMEOUT)
    assert second.returncode != 0
    assert error_lines(second.stderr) == [
        f"error: run folder {str(run)!r} is in use by process {holder} (lock {run / '.rlhf_lab.lock'}); wait for it "
        "to end or choose another trainer.output_dir"], second.stderr[-3000:]
    assert {path.name: path.read_text() for path in (run / ".hydra").glob("*.yaml")} == record


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm=nosuch"], "error: algorithm='nosuch' is not an option; choose from: "),
    (["data=jsonl", "data.path={bad}"], "error: data file '{bad}', line 2: not valid JSON"),
], ids=["config_validation", "after_the_process_group_exists"])
def test_a_user_error_under_torchrun_is_one_line_from_rank_zero(tmp_path: Path, overrides: list[str],
                                                                message: str) -> None:
    """Every rank finds the same mistake (on the command line, or in the data file once the ranks have met): rank 0
    prints it and exits with status 2, the other ranks say nothing; torchrun adds its report of the ranks' exit codes
    (no traceback of rlhf_lab's)."""
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "Tell me"}\nnot json\n')
    overrides = [o.format(bad=bad) for o in overrides]
    result = subprocess.run(command(2, *QUICK, *overrides, f"trainer.output_dir={tmp_path / 'run'}"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=TIMEOUT, env=environment())
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith(message.format(bad=bad)), result.stderr[-3000:]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 2 ", result.stderr)
    assert "rlhf_lab/" not in "".join(line for line in result.stderr.splitlines() if line.lstrip().startswith("File"))


# ------------------------------------------------------------------------ stale launcher variables, one process
ONE_PROCESS = ["model=tiny", "trainer.precision=fp32", "trainer.steps=1", "trainer.prompts_per_step=2",
               "algorithm.group_size=2", "trainer.max_new_tokens=4", "trainer.progress_bar=false", "reward=length",
               *QUICK]


def stale_variables() -> dict[str, str]:
    """Launcher variables left over from another job: rank 0 of two, at a port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_stale_launcher_variables_without_a_launcher_are_refused_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """Rank 0 of two, with a rendezvous address, in a process no launcher started (no LOCAL_RANK): it would wait
    for a peer that never comes. Refused before anything runs."""
    for key in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    stale = stale_variables()
    for key, value in stale.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(ONE_PROCESS)
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={stale['MASTER_PORT']} names 2 processes, "
        "but no launcher "
        "started this one (LOCAL_RANK unset: left over from another job?), and it would wait for the others at the "
        "rendezvous; unset them for one process, or launch with torchrun --nproc_per_node=N -m rlhf_lab\n")
    assert list(tmp_path.iterdir()) == []


def test_a_rendezvous_nobody_joins_ends_after_the_collective_timeout_in_one_line(tmp_path: Path) -> None:
    """The same variables with LOCAL_RANK (as a launcher would set them), but no peer: rank 0 waits
    ``trainer.collective_timeout_s`` at the rendezvous, then stops with one line, not torch's 30-minute wait."""
    stale = stale_variables()
    env = {**environment(), **stale, "LOCAL_RANK": "0"}
    # torch's own wait is 30 minutes, past the hang guard: a process that waited it fails here with TimeoutExpired.
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", *ONE_PROCESS, "trainer.collective_timeout_s=2",
                             f"trainer.output_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=HANG_GUARD_S, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: rank 0 of WORLD_SIZE=2 waited trainer.collective_timeout_s=2 for the other processes at "
        f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{stale['MASTER_PORT']} in vain (Timed out after "), result.stderr
    assert len(result.stderr.splitlines()) == 1
