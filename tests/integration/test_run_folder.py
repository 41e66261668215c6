"""A run folder is written by one run: a second run into a folder that holds a finished run (its summary.json) or
checkpoints is refused in one line naming the folder and the choices, before anything is written, for every save
policy; ``trainer.overwrite=true`` replaces it (rlhf_lab/training/checkpoint_find.py: prepare_run_folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_lab.errors import CheckpointError
from rlhf_lab.training.loop import Trainer

RUN_FILES = ("summary.json", "metrics.jsonl")


def finished_run(compose, tiny_overrides, tmp_path: Path, save: str) -> tuple[list[str], dict[str, bytes]]:
    overrides = [*tiny_overrides(tmp_path), "trainer.steps=1", "trainer.eval_prompts=0", f"trainer.save={save}"]
    Trainer(compose(overrides), tmp_path / "run").train()
    return overrides, {name: (tmp_path / "run" / name).read_bytes() for name in RUN_FILES}


@pytest.mark.parametrize(("save", "resume", "expected"), [
    ("none", None, "holds a finished run (its summary.json): a new run would replace its summary.json and "
                   "metrics.jsonl; choose another trainer.output_dir (or hydra.run.dir), or replace it with "
                   "trainer.overwrite=true"),
    ("none", "auto", "holds a finished run (its summary.json and no checkpoint): a new run would replace"),
    ("model", None, "already holds checkpoints; continue it with trainer.resume=auto, choose another "
                    "trainer.output_dir, or replace it with trainer.overwrite=true"),
    ("all", None, "already holds checkpoints; continue it with trainer.resume=auto"),
])
def test_a_second_run_into_a_finished_run_s_folder_is_one_line_and_writes_nothing(compose, tiny_overrides, tmp_path,
                                                                                 save, resume, expected) -> None:
    overrides, before = finished_run(compose, tiny_overrides, tmp_path, save)
    again = [*overrides, "trainer.steps=2", *([f"trainer.resume={resume}"] if resume else [])]
    with pytest.raises(CheckpointError) as refused:
        Trainer(compose(again), tmp_path / "run")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"run folder {str(tmp_path / 'run')!r} ")
    assert expected in message
    assert {name: (tmp_path / "run" / name).read_bytes() for name in RUN_FILES} == before  # nothing replaced


def test_overwrite_replaces_the_finished_run(compose, tiny_overrides, tmp_path, capsys) -> None:
    overrides, before = finished_run(compose, tiny_overrides, tmp_path, "all")
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir()
    Trainer(compose([*overrides, "trainer.save=none", "trainer.overwrite=true"]), tmp_path / "run").train()
    assert f"trainer.overwrite=true: replacing the run in {tmp_path / 'run'}" in capsys.readouterr().out
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "run" / "checkpoints").exists()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and (tmp_path / "run" / "summary.json").read_bytes() != before["summary.json"]


def test_a_run_that_died_before_its_first_checkpoint_is_started_afresh(compose, tiny_overrides, tmp_path) -> None:
    """No summary, no checkpoint: nothing to resume and nothing finished; its partial logs are emptied (as before)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')
    Trainer(compose([*tiny_overrides(tmp_path), "trainer.steps=1", "trainer.eval_prompts=0", "trainer.save=none"]),
            run).train()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1 and (run / "summary.json").is_file()


def test_a_resume_on_an_edited_data_file_is_one_line_naming_it(compose, tiny_overrides, tmp_path) -> None:
    """The checkpoint records the prompts' digest; the same file resumes, an edited one is refused naming it."""
    from rlhf_lab.errors import ConfigError

    data = tmp_path / "prompts.jsonl"
    rows = [f'{{"prompt": "review number {i} says"}}' for i in range(12)]
    data.write_text("\n".join(rows) + "\n")
    overrides = [*tiny_overrides(tmp_path), "data=local", f"data.path={data}", "trainer.eval_prompts=0",
                 "trainer.checkpoint_every=1", "trainer.save=all"]
    Trainer(compose([*overrides, "trainer.steps=1"]), tmp_path / "run").train()
    data.write_text("\n".join(rows[:5] + ['{"prompt": "an edited row"}'] + rows[6:]) + "\n")
    with pytest.raises(ConfigError) as refused:
        Trainer(compose([*overrides, "trainer.steps=2", "trainer.resume=auto"]), tmp_path / "run").train()
    message = str(refused.value)
    assert message.startswith(f"the prompts of data.path={data} are not those ") and "\n" not in message
    assert "the data was edited since; put it back to resume, or start a fresh run in a new folder" in message
    data.write_text("\n".join(rows) + "\n")  # put back: it resumes
    Trainer(compose([*overrides, "trainer.steps=2", "trainer.resume=auto"]), tmp_path / "run").train()
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
