"""Without a progress bar (``trainer.progress_bar=false``, as the experiments and many sweeps set it) a run logs a
line at each tenth of its steps, from where a resume starts (rlhf_lab/runtime/console.py)."""

from __future__ import annotations

import re

from rlhf_lab.runtime.console import format_duration, progress_bar


def lines_of(capsys, steps: range, initial: int, total: int) -> list[str]:
    assert list(progress_bar(steps, False, initial, total)) == list(steps)
    return capsys.readouterr().out.splitlines()


def test_a_line_at_each_tenth_and_none_at_the_end(capsys) -> None:
    lines = lines_of(capsys, range(0, 20), 0, 20)
    assert [re.sub(r", about .* left$", "", line) for line in lines] == [
        f"train: step {done}/20 ({5 * done}%)" for done in range(2, 20, 2)]
    assert all(re.fullmatch(r".*, about (\d+ min )?\d+ s left", line) for line in lines)


def test_a_resume_starts_counting_from_its_first_step(capsys) -> None:
    lines = lines_of(capsys, range(5, 20), 5, 20)
    assert [line.split(" (")[0] for line in lines] == [f"train: step {done}/20" for done in range(6, 20, 2)]


def test_durations_read_as_minutes_and_seconds() -> None:
    assert format_duration(12.4) == "12 s" and format_duration(250) == "4 min 10 s" and format_duration(60) == "1 min 0 s"


def test_a_short_run_says_nothing(capsys) -> None:
    assert lines_of(capsys, range(0, 19), 0, 19) == []


def test_the_sweep_counts_a_command_line_key_once() -> None:
    """The basic sweeper crosses ``hydra.sweeper.params`` with the command line's sweeps, a key on both taking the
    command line's values: 3 arms x 2 seeds in the params, 2 arms x 3 seeds on the command line = 6 jobs, not 36."""
    from omegaconf import OmegaConf

    from rlhf_lab.app.sweep_watch import count_jobs

    def hydra(task: list[str]):
        return OmegaConf.create({"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                             "params": {"+kl_arm": "a,b,c", "seed": "0,1"}},
                                 "overrides": {"task": task}})

    assert count_jobs(hydra([])) == 6
    assert count_jobs(hydra(["+kl_arm=a,b", "seed=100,101,102", "trainer.steps=5"])) == 6
    assert count_jobs(hydra(["seed=7", "lr=1,2"])) == 6  # 3 arms x 1 seed x 2 rates
