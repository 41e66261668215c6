"""Beside every response, the prompt the model saw: an environment's opening, not the data row it was made from.

``env=guess_number`` opens every episode with its own question whatever the data row says, so a record that pairs
the data set's prompt with an episode's response is caught here: in the console, ``samples.jsonl``, the trackers'
evaluation table and ``rlhf-lab eval``'s ``eval_samples.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_lab.training.loop import Trainer

pytestmark = pytest.mark.integration

OPENING = "user: I am thinking of a whole number from 1 to 16."
ENV = ["env=guess_number", "trainer.max_new_tokens=6", "env.max_tokens=64", "env.stop=[a,e,i,o,u,n,t,s]",
       "trainer.eval_prompts=2", "trainer.samples_per_step_logged=4"]


def test_every_record_shows_the_environment_opening(compose, tiny_overrides, tmp_path: Path, capsys,
                                                   run_cli) -> None:
    trainer = Trainer(compose([*tiny_overrides(tmp_path), *ENV]), tmp_path / "run")
    data_prompts = set(trainer.prompts.train) | set(trainer.prompts.eval)
    tables: list[dict] = []
    trainer.records.tracker.log_eval_samples = lambda rows, step: tables.extend(rows)  # every tracker's input
    trainer.train()
    printed = capsys.readouterr().out
    assert f"[before training] prompt: {OPENING}" in printed and f"[after training] prompt: {OPENING}" in printed

    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(tables) == 4 and len(samples) == 8  # 2 evaluations x 2 prompts; 2 steps x 4 samples
    for row in [*tables, *samples]:
        assert row["prompt"].startswith(OPENING) and row["prompt"] not in data_prompts

    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {line}\n" for line in [*tiny_overrides(None), *ENV]))
    code, _, err = run_cli(["eval", str(tmp_path / "run"), "--out", str(tmp_path / "eval")])
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["prompt"].startswith(OPENING) for row in rows)
