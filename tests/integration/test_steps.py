"""One step convention everywhere (docs/guides/outputs.md#steps): step N is the policy after N updates.

One tiny 4-step run with an evaluation and a checkpoint every 2 steps, read back: the lines of ``metrics.jsonl``,
the checkpoint folders and their states, ``summary.json``, ``rlhf-lab eval`` of a checkpoint, the export's model
card; and a checkpoint named the way older runs named them (after their last step) still resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import rlhf_lab
from rlhf_lab.trackers.jsonl import read_jsonl
from rlhf_lab.training.checkpoint import read_state, updates_held

STEPS = ["trainer.steps=4", "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.keep_last_n=5"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import tiny_overrides

    folder = tmp_path_factory.mktemp("steps") / "run"
    overrides = [*tiny_overrides(None), *STEPS]
    rlhf_lab.train(overrides, run_dir=folder)
    (folder / ".hydra").mkdir(exist_ok=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {line}\n" for line in overrides))
    return folder


def evaluations(run_dir: Path) -> dict[int, dict]:
    return {line["step"]: line for line in read_jsonl(run_dir / "metrics.jsonl") if "eval/reward/mean" in line}


def test_metrics_lines_count_updates(run_dir: Path) -> None:
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines if "reward/mean" in line] == [0, 1, 2, 3]
    # Before any update, after 2 (in step 2's line, whose samples come from the same policy), after all 4.
    assert [(line["step"], "reward/mean" in line) for line in lines if "eval/reward/mean" in line] == [
        (0, False), (2, True), (4, False)]


def test_a_checkpoint_is_named_by_the_updates_it_holds(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_4"]
    assert (root / "latest").read_text() == "step_4"
    assert [read_state(root / name)["step"] for name in ("step_2", "step_4")] == [1, 3]  # the last step trained
    assert [updates_held(root / name) for name in ("step_2", "step_4")] == [2, 4]


def test_the_summary_counts_the_same_steps_and_its_wall_time_covers_training(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["eval/reward/mean"] == evaluations(run_dir)[4]["eval/reward/mean"]
    assert summary["time/total_s"] >= summary["time/train_s"] > 0


def test_eval_of_a_checkpoint_logs_at_the_step_training_evaluated_it(run_dir: Path, tmp_path: Path) -> None:
    from rlhf_lab.tools.evaluate import evaluate_source

    for name, step in (("step_2", 2), ("step_4", 4)):
        result = evaluate_source(str(run_dir / "checkpoints" / name), [], out=tmp_path / name)
        assert result["step"] == step and step in evaluations(run_dir)
        assert json.loads((tmp_path / name / "eval.json").read_text())["step"] == step
        assert {row["step"] for row in read_jsonl(tmp_path / name / "eval_samples.jsonl")} == {step}


def test_the_model_card_names_the_step_it_exports(run_dir: Path, tmp_path: Path) -> None:
    from rlhf_lab.tools.export import export

    export(run_dir, tmp_path / "last")
    card = (tmp_path / "last" / "README.md").read_text()
    assert "(step 4: the policy after 4 updates)" in card and "| `steps` | 4 |" in card
    assert "this policy is from step" not in card
    export(run_dir / "checkpoints" / "step_2", tmp_path / "earlier")
    card = (tmp_path / "earlier" / "README.md").read_text()
    assert "(step 2: the policy after 2 updates)" in card
    assert "The run's results at its end, step 4; this policy is from step 2." in card


def test_a_checkpoint_with_an_older_name_resumes_at_the_step_after_it(run_dir: Path, tmp_path: Path) -> None:
    """Older runs named a checkpoint after its last step: ``step_1`` held 2 updates."""
    from conftest import compose, tiny_overrides

    from rlhf_lab.training.loop import Trainer

    older = tmp_path / "run"
    (older / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step_2", older / "checkpoints" / "step_1")
    (older / "checkpoints" / "latest").write_text("step_1")
    assert updates_held(older / "checkpoints" / "step_1") == 2
    trainer = Trainer(compose([*tiny_overrides(None), *STEPS, "trainer.resume=auto"]),
                      older)
    assert trainer.start_step == 2
    trainer.train()
    assert sorted(p.name for p in (older / "checkpoints").glob("step_*")) == ["step_1", "step_4"]
    assert [line["step"] for line in read_jsonl(older / "metrics.jsonl")] == [2, 3, 4]  # 2 with its evaluation
