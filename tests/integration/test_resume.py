"""Exact resume from the command line: a run killed at a random step, or stopped by SIGTERM, and resumed
in the same folder writes the same ``metrics.jsonl`` as an uninterrupted run (wall-time keys aside).

Each run is a real ``python -m rlhf_lab`` process on the tiny model. The uninterrupted reference of an
algorithm runs alongside the interrupted one (two processes, one thread each).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_lab.registry import names
from tests.limits import HANG_GUARD_S

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
TINY = [
    "model=tiny", f"trainer.steps={STEPS}", "trainer.prompts_per_step=2", "algorithm.group_size=2",
    "trainer.max_new_tokens=4", "trainer.eval_prompts=2", "trainer.eval_every=2", "trainer.progress_bar=false",
    "trainer.num_threads=1", "trainer.lr=1e-3",
]
ALGORITHMS = {
    "grpo": ["algorithm=grpo"],
    "ppo": ["algorithm=ppo", "algorithm.mini_batch_size=2", "kl=kl", "kl.placement=reward"],
}
WALL_TIME_KEYS = ("time/", "throughput/", "perf/")
TIMEOUT = HANG_GUARD_S


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")])))
    return env


class Run:
    """One ``python -m rlhf_lab`` process writing to ``run_dir``; its output is kept in files."""

    def __init__(self, cwd: Path, run_dir: Path, *overrides: str, command: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.log = cwd / f"{run_dir.name}.{time.monotonic_ns()}.log"
        command = command or [sys.executable, "-m", "rlhf_lab", *TINY, *overrides, f"trainer.output_dir={run_dir}"]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                            env=environment())

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise

    @property
    def output(self) -> str:
        return self.log.read_text()

    def wait_for_step(self, step: int) -> None:
        """Block until the training line of ``step`` is in metrics.jsonl."""
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the run ended (status {self.process.returncode}) before step {step}:\n{self.output}")
            if any(r.get("step") == step and "reward/mean" in r for r in read_records(metrics)):
                return
            time.sleep(0.05)
        self.process.kill()
        pytest.fail(f"step {step} did not appear in {TIMEOUT} s")


def read_records(path: Path) -> list[dict]:
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                records.append(json.loads(line))
    return records


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(WALL_TIME_KEYS)} for r in records]


def assert_same_history(got_dir: Path, expected_dir: Path) -> None:
    lines = (got_dir / "metrics.jsonl").read_text().splitlines()
    got = [json.loads(line) for line in lines]  # every line parses: a torn line was repaired
    expected = read_records(expected_dir / "metrics.jsonl")
    # eval at start (step 0), every training step once, the final eval (step STEPS): nothing twice or missing
    assert [(r["step"], "reward/mean" in r) for r in got] == (
        [(0, False)] + [(s, True) for s in range(STEPS)] + [(STEPS, False)]
    )
    assert comparable(got) == comparable(expected)
    samples = [(d / "samples.jsonl").read_text().splitlines() for d in (got_dir, expected_dir)]
    assert samples[0] == samples[1]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (got_dir, expected_dir)]
    for summary in summaries:
        summary.pop("run_dir")
    assert comparable(summaries[:1]) == comparable(summaries[1:])


def requires(algorithm: str) -> None:
    if not (PROJECT_ROOT / "conf" / "algorithm" / f"{algorithm}.yaml").is_file() or algorithm not in names("algorithm"):
        pytest.skip(f"algorithm={algorithm} is not there yet")


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted GRPO run, started in the background the first time a test asks for it."""
    cwd = tmp_path_factory.mktemp("grpo_reference")
    run = Run(cwd, cwd / "reference", *ALGORITHMS["grpo"])

    def finished() -> Path:
        if run.process.returncode is None:
            assert run.wait() == 0, run.output
        return run.run_dir

    yield finished
    if run.process.poll() is None:
        run.process.kill()
        run.process.wait()


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_run_killed_at_a_random_step_resumes_to_the_same_metrics(tmp_path: Path, algorithm: str,
                                                                   grpo_reference) -> None:
    requires(algorithm)
    overrides = ALGORITHMS[algorithm]
    reference = None if algorithm == "grpo" else Run(tmp_path, tmp_path / "reference", *overrides)
    kill_after = random.Random(f"kill {algorithm}").randint(1, STEPS - 2)
    interrupted = [*overrides, "trainer.checkpoint_every=1", "trainer.keep_last_n=2", "trainer.resume=auto"]

    victim = Run(tmp_path, tmp_path / "run", *interrupted)
    victim.wait_for_step(kill_after)
    victim.process.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert f"trainer.resume=auto: no checkpoint in {tmp_path / 'run' / 'checkpoints'}, starting fresh" in victim.output
    with open(tmp_path / "run" / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 99, "reward/mean": 0.12')  # a torn last line, as a kill mid-write leaves

    resumed = Run(tmp_path, tmp_path / "run", *interrupted)
    assert resumed.wait() == 0, resumed.output
    start = int(resumed.output.split(" at step ")[1].split()[0])
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/step_{start} at step {start}" in resumed.output
    assert kill_after <= start <= STEPS  # from the checkpoint of step kill_after - 1 or a later one
    assert "Traceback" not in resumed.output

    expected_dir = grpo_reference() if reference is None else reference.run_dir
    if reference is not None:
        assert reference.wait() == 0, reference.output
    assert_same_history(tmp_path / "run", expected_dir)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "latest", f"step_{STEPS - 1}", f"step_{STEPS}"
    ]


def test_sigterm_checkpoints_exits_cleanly_and_the_printed_command_resumes(tmp_path: Path, grpo_reference) -> None:
    run_dir = tmp_path / "run"
    run = Run(tmp_path, run_dir, *ALGORITHMS["grpo"])  # checkpoint_every=0: the signal's checkpoint only
    run.wait_for_step(1)
    run.process.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM
    output = run.output
    assert "Traceback" not in output
    assert "received SIGTERM: finishing the current step, then writing a checkpoint" in output
    stop_line = next(line for line in output.splitlines() if line.startswith("stopped after step "))
    step = int(stop_line.split()[3].rstrip(":"))
    assert stop_line == (
        f"stopped after step {step}: received SIGTERM; checkpoint {run_dir / 'checkpoints' / f'step_{step + 1}'} "
        f"written; continue with: trainer.resume=auto trainer.output_dir={run_dir.resolve()}"
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", f"step_{step + 1}"]
    command_line = next(line for line in output.splitlines() if line.startswith("to resume, run: "))
    command = shlex.split(command_line.removeprefix("to resume, run: "))
    assert command[0] in ("python", sys.executable) and command[1:3] == ["-m", "rlhf_lab"]  # what this shell runs
    assert command[-2:] == ["trainer.resume=auto", f"trainer.output_dir={run_dir.resolve()}"]
    assert set(TINY) <= set(command)

    resumed = Run(tmp_path, run_dir, command=[sys.executable, *command[1:]])
    assert resumed.wait() == 0, resumed.output
    assert f"at step {step + 1}" in resumed.output
    assert_same_history(run_dir, grpo_reference())


def test_resume_auto_without_a_checkpoint_starts_fresh_and_drops_stale_lines(compose, tiny_overrides,
                                                                             tmp_path: Path) -> None:
    """A run killed before its first checkpoint left metrics behind: they must not mix with the new run."""
    from rlhf_lab.training.loop import Trainer

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / ".step_0.tmp123").mkdir(parents=True)  # a save that never finished
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 1.0}\n{"step": 1, "rew')
    trainer = Trainer(compose([*tiny_overrides(None), "trainer.resume=auto"]), run_dir)
    assert trainer.start_step == 0 and trainer.resume_from is None
    assert (run_dir / "metrics.jsonl").read_text() == ""


def test_ctrl_c_finishes_the_step_and_a_second_one_aborts(compose, tiny_overrides, tmp_path: Path) -> None:
    from rlhf_lab.training.checkpoint import latest_checkpoint
    from rlhf_lab.training.loop import Trainer, TrainingStopped

    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(None), "trainer.steps=4", "trainer.eval_prompts=0"]

    def interrupt_at(trainer: Trainer, at_step: int, times: int) -> None:
        train_step = trainer.train_step

        def step_with_ctrl_c(step: int) -> dict:
            metrics = train_step(step)
            for _ in range(times if step == at_step else 0):
                os.kill(os.getpid(), signal.SIGINT)  # handled in this thread before os.kill returns
            return metrics

        trainer.train_step = step_with_ctrl_c

    trainer = Trainer(compose(overrides), run_dir)
    interrupt_at(trainer, at_step=1, times=1)
    before = signal.getsignal(signal.SIGINT)  # Python's default handler; SIG_IGN in a shell's background job
    with pytest.raises(TrainingStopped) as raised:
        trainer.train()
    assert raised.value.exit_code == 128 + signal.SIGINT
    assert str(raised.value).startswith("stopped after step 1: received SIGINT; checkpoint ")
    assert raised.value.resume_overrides == ("trainer.resume=auto", f"trainer.output_dir={run_dir.resolve()}")
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_2"
    assert signal.getsignal(signal.SIGINT) is before  # the handler was put back

    resumed = Trainer(compose([*overrides, "trainer.resume=auto"]), run_dir)
    assert resumed.start_step == 2
    interrupt_at(resumed, at_step=2, times=2)
    with pytest.raises(KeyboardInterrupt):
        resumed.train()
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_2"
