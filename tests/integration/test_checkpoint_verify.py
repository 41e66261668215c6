"""Verified checkpoints: every file's sha256 and the state's own checksum are checked before a resume loads
anything; a damaged checkpoint falls back to the previous complete one with one warning line, and the
``latest`` pointer is never followed out of its ``checkpoints/`` folder.

In-process, on the small Llama of ``test_reliability.py`` (a checkpoint is a few hundred kilobytes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_reliability import save, tiny_parts, train_once

from rlhf_lab.errors import CheckpointError
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training.resume_contract import verified_checkpoint
from rlhf_lab.training.verify import damage

WEIGHTS = "model/model.safetensors"


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """Checkpoints step_3, step_4 and step_5 under tmp_path/checkpoints (the model trained between them)."""
    parts = tiny_parts()
    root = tmp_path / "checkpoints"
    for step in (3, 4, 5):
        train_once(*parts)
        save(root, step, parts)
    return root


def _header_bytes(folder: Path) -> None:
    """Same-size damage to the safetensors header (the JSON after the 8-byte length): a dtype rewritten."""
    path = folder / WEIGHTS
    data = path.read_bytes()
    assert b'"F32"' in data[:4096]
    path.write_bytes(data.replace(b'"F32"', b'"F16"', 1))


def _data_bytes(folder: Path) -> None:
    """One flipped bit in the weights' data: it would load silently."""
    path = folder / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _optimizer_bytes(folder: Path) -> None:
    path = folder / ckpt.OPTIMIZER_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x80
    path.write_bytes(bytes(data))


def _missing_key(folder: Path) -> None:
    state = json.loads((folder / ckpt.STATE_FILE).read_text())
    del state["kl_controller"]
    (folder / ckpt.STATE_FILE).write_text(json.dumps(state))


def _edited_value(folder: Path) -> None:
    state = json.loads((folder / ckpt.STATE_FILE).read_text())
    state["step"] = 6
    (folder / ckpt.STATE_FILE).write_text(json.dumps(state))


def _unreadable_file(folder: Path) -> None:
    (folder / ckpt.RNG_FILE).unlink()
    (folder / ckpt.RNG_FILE).mkdir()  # there, but not a file that can be read


DAMAGE = {
    "header_bytes": (_header_bytes, f"{WEIGHTS} does not match its sha256 (corrupted)"),
    "data_bytes": (_data_bytes, f"{WEIGHTS} does not match its sha256 (corrupted)"),
    "optimizer_bytes": (_optimizer_bytes, f"{ckpt.OPTIMIZER_FILE} does not match its sha256 (corrupted)"),
    "missing_key": (_missing_key, f"{ckpt.STATE_FILE} has no 'kl_controller' key"),
    "edited_value": (_edited_value, f"{ckpt.STATE_FILE} does not match its checksum (edited or corrupted)"),
    "unreadable_file": (_unreadable_file, f"{ckpt.RNG_FILE} is unreadable (not a file)"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_falls_back_to_the_previous_with_one_warning(three: Path, case: str, capsys) -> None:
    damage_it, problem = DAMAGE[case]
    newest = three / "step_5"
    assert damage(newest, ckpt.STATE_FILE) is None
    damage_it(newest)
    assert damage(newest, ckpt.STATE_FILE) == problem
    assert verified_checkpoint(newest) == three / "step_4"
    assert capsys.readouterr().err == (
        f"warning: checkpoint {newest} is damaged ({problem}); falling back to {three / 'step_4'} (step 4)\n"
    )
    fresh = tiny_parts(seed=1)
    # step_4 holds 4 updates: its last trained step is 3 (steps count from 0)
    assert ckpt.load_checkpoint(three / "step_4", *fresh, uses_adapter=False)["step"] == 3
    assert ckpt.updates_held(three / "step_4") == 4


def test_two_damaged_checkpoints_fall_back_two_steps_and_none_left_is_one_line(three: Path, capsys) -> None:
    _data_bytes(three / "step_5")
    _missing_key(three / "step_4")
    assert verified_checkpoint(three / "step_5") == three / "step_3"
    assert capsys.readouterr().err == (
        f"warning: checkpoint {three / 'step_4'} is damaged ({ckpt.STATE_FILE} has no 'kl_controller' key); "
        f"falling back to {three / 'step_3'} (step 3)\n"
    )
    _header_bytes(three / "step_3")
    with pytest.raises(CheckpointError) as raised:
        verified_checkpoint(three / "step_5")
    assert str(raised.value) == (
        f"checkpoint {three / 'step_5'} is damaged ({WEIGHTS} does not match its sha256 (corrupted)) and no "
        f"earlier complete checkpoint in {three} checks out; start a fresh run (another trainer.output_dir, "
        "without trainer.resume)"
    )


def test_the_latest_pointer_is_never_followed_out_of_the_checkpoints_folder(three: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "checkpoints"
    parts = tiny_parts(seed=2)
    save(elsewhere, 9, parts)
    for pointer in ("../elsewhere/checkpoints/step_9", str(elsewhere / "step_9"), "step_4/../../elsewhere/checkpoints/step_9"):
        (three / "latest").write_text(pointer)
        assert ckpt.latest_checkpoint(three) == three / "step_5", pointer
        assert ckpt.resolve_resume("auto", three) == three / "step_5"
    # A step folder that is a link to another run's checkpoint is not one of this run's.
    (three / "latest").write_text("step_7")
    os.symlink(elsewhere / "step_9", three / "step_7")
    assert ckpt.complete_checkpoints(three) == [three / "step_3", three / "step_4", three / "step_5"]
    assert ckpt.latest_checkpoint(three) == three / "step_5"


def test_a_checkpoint_without_digests_is_checked_by_size_and_a_bad_header_is_one_line(three: Path) -> None:
    """Checkpoints saved before digests existed still load; a damaged safetensors header is a CheckpointError."""
    folder = three / "step_5"
    state = json.loads((folder / ckpt.STATE_FILE).read_text())
    for key in ("sha256", "keys", "state_sha256"):
        state.pop(key)
    (folder / ckpt.STATE_FILE).write_text(json.dumps(state))
    assert damage(folder, ckpt.STATE_FILE) is None
    weights = folder / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[8:12] = b"!!!!"  # the header's JSON, same size
    weights.write_bytes(bytes(data))
    assert damage(folder, ckpt.STATE_FILE) is None  # sizes only: it cannot tell
    with pytest.raises(CheckpointError, match="has an unreadable safetensors file") as raised:
        ckpt.load_checkpoint(folder, *tiny_parts(seed=1), uses_adapter=False)
    assert "\n" not in str(raised.value)
