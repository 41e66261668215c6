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
