"""locate_checkpoint: the one resolution of "which checkpoint does this path name" (resume, export, eval)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_lab.errors import CheckpointError
from rlhf_lab.tools.export import find_checkpoint
from rlhf_lab.training.checkpoint import locate_checkpoint, resolve_resume


def fake_checkpoint(folder: Path, step: int, whole: bool = True) -> Path:
    """A checkpoint folder whose manifest lists its files with their sizes; ``whole=False`` truncates one."""
    files = {"optimizer.safetensors": b"opt", "rng.safetensors": b"rng", "model/model.safetensors": b"weights"}
    for relative, content in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(content if whole or relative != "optimizer.safetensors" else b"o")
    state = {"step": step, "files": {relative: len(content) for relative, content in files.items()}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_a_step_folder_a_checkpoints_folder_and_a_run_folder_name_the_same_checkpoint(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    # find_checkpoint also verifies the manifest's digests (tests/integration/test_bad_inputs_round3.py); these
    # stand-ins have sizes only, and the question here is which folder is named.
    monkeypatch.setattr("rlhf_lab.training.verify.damage", lambda folder, state_file: None)
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root / "step_1", 1)
    newest = fake_checkpoint(root / "step_3", 3)
    for path in (newest, root, tmp_path / "run"):
        assert locate_checkpoint(path, "x") == newest
        assert find_checkpoint(path) == newest
        assert resolve_resume(str(path), tmp_path / "elsewhere") == newest
    assert locate_checkpoint(tmp_path, "x") is None  # no checkpoint under the parent of the run folder


def test_an_interrupted_step_folder_is_one_line_naming_the_caller_label(tmp_path: Path) -> None:
    torn = fake_checkpoint(tmp_path / "checkpoints" / "step_2", 2, whole=False)
    with pytest.raises(CheckpointError, match=r"^trainer.resume='T' is an incomplete checkpoint \(a save was "
                                              r"interrupted\)$"):
        locate_checkpoint(torn, "trainer.resume='T'")
    with pytest.raises(CheckpointError, match=r"is an incomplete checkpoint"):
        find_checkpoint(torn)
    # A run folder whose only checkpoint is torn holds none.
    assert locate_checkpoint(tmp_path, "x") is None
