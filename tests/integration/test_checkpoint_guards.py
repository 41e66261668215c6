"""What guards a run's checkpoints beyond the RL loop's own tests: the offline stages resume through the same
verified path (a damaged checkpoint falls back or is refused in one line; a new ``trainer.lr`` is honoured), a
full disk during a checkpoint write is one line with the previous checkpoint intact, and ``rlhf-lab eval`` holds
the lock of the run folder it writes into.

On ``model=tiny``, in-process (the CLI through ``run_cli``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_checkpoint_verify import _data_bytes
from test_offline_stages import synthetic_pairs, train_lines, write_jsonl
from test_reliability import save, tiny_parts, train_once

import rlhf_lab
from rlhf_lab.errors import CheckpointError
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training import run_lock
from rlhf_lab.training.launch import run
from rlhf_lab.training.verify import damage

WEIGHTS = "model/model.safetensors"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pairs")
    write_jsonl(folder / "train.jsonl", synthetic_pairs(16, seed=0))
    write_jsonl(folder / "eval.jsonl", synthetic_pairs(4, seed=1))
    return folder


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    rows = [{"prompt": "Say hi", "response": "Hi there."}, {"prompt": "Say bye", "response": "Bye now."}]
    return write_jsonl(tmp_path_factory.mktemp("demos") / "demos.jsonl", rows)


def tiny(tiny_overrides, out: Path, *overrides: str) -> list[str]:
    """The tiny run's overrides into ``out``, ``overrides`` replacing its keys (the CLI takes each key once)."""
    keys = {line.split("=", 1)[0] for line in overrides}
    kept = [line for line in tiny_overrides(None) if line.split("=", 1)[0] not in keys]
    return [*kept, *overrides, f"trainer.output_dir={out}"]


def stage_overrides(name: str, pairs: Path, demos: Path) -> list[str]:
    data = (["data=demonstrations", f"data.path={demos}"] if name == "sft"
            else ["data=preferences", f"data.path={pairs}"])
    return [f"algorithm={name}", *data, "trainer.eval_prompts=0"]


def one_line_error(code: int, err: str) -> str:
    """The message of a one-line user error (exit 2, one stderr line, no traceback)."""
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err[len("error: "):].strip()


# ----------------------------------------------------------------------------- offline resume: digests
def test_reward_model_resume_verifies_digests_falls_back_and_refuses_in_one_line(tiny_overrides, run_cli, pairs,
                                                                                  demos, tmp_path, capsys):
    out = tmp_path / "rm"
    common = [*stage_overrides("reward_model", pairs, demos), "trainer.checkpoint_every=1", "trainer.lr=1e-2"]
    code, _, err = run_cli(tiny(tiny_overrides, out, *common))
    assert code == 0, err
    trained = train_lines(out)
    root = out / "checkpoints"
    _data_bytes(root / "step_2")  # one flipped bit in the weights: it would load silently
    code, _, err = run_cli(tiny(tiny_overrides, out, *common, "trainer.steps=3", "trainer.resume=auto"))
    assert code == 0, err
    problem = f"{WEIGHTS} does not match its sha256 (corrupted)"
    assert f"checkpoint {root / 'step_2'} is damaged ({problem}); falling back to {root / 'step_1'} (step 1)" in err
    resumed = train_lines(out)
    assert [line["step"] for line in resumed] == [0, 1, 2]
    assert resumed[1]["loss/total"] == trained[1]["loss/total"]  # step 1 again, from the intact weights

    for step in (2, 3):
        _data_bytes(root / f"step_{step}")
    resume = tiny(tiny_overrides, out, *common, "trainer.steps=4", "trainer.resume=auto")
    message = one_line_error(*run_cli(resume)[::2])
    assert message == (f"checkpoint {root / 'step_3'} is damaged ({problem}) and no earlier complete checkpoint in "
                       f"{root} checks out; start a fresh run (another trainer.output_dir, without trainer.resume)")


# ----------------------------------------------------------------------------- offline resume: a new lr
@pytest.mark.parametrize("name", ["reward_model", "sft", "dpo"])
def test_offline_resume_runs_a_changed_lr_as_the_rl_loop_does(compose, tiny_overrides, pairs, demos, tmp_path, name,
                                                               capsys):
    out = tmp_path / name
    common = [*tiny_overrides(None), *stage_overrides(name, pairs, demos), f"trainer.output_dir={out}"]
    run(compose([*common, "trainer.steps=1", "trainer.lr=1e-3"]), out)
    capsys.readouterr()
    run(compose([*common, "trainer.steps=2", "trainer.lr=0.5", "trainer.resume=auto"]), out)
    assert "resuming with changed trainer.steps: 1 -> 2, trainer.lr: 0.001 -> 0.5" in capsys.readouterr().out
    assert [(line["step"], line["lr"]) for line in train_lines(out)] == [(0, 1e-3), (1, 0.5)]
    stored = json.loads((out / "checkpoints" / "step_2" / ckpt.CONFIG_FILE).read_text())
    assert stored["trainer"]["lr"] == 0.5


# ----------------------------------------------------------------------------- a full disk
FULL = {
    "enospc": (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "no space left"),
    "edquot": (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), "disk quota exceeded"),
    "safetensors": (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                    "no space left"),
}


@pytest.mark.parametrize("case", list(FULL))
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_last_checkpoint_resumes(tiny_overrides, run_cli,
                                                                                     tmp_path, monkeypatch, case):
    error, told = FULL[case]
    write = ckpt.save_file

    def full_at_step_3(tensors, path, *args, **kwargs):
        if f"{ckpt.TEMP_PREFIX}3." in str(path):
            raise error
        return write(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", full_at_step_3)
    common = tiny(tiny_overrides, tmp_path / "run", "trainer.eval_prompts=0", "trainer.checkpoint_every=1",
                  "trainer.steps=3")
    code, _, err = run_cli(common)
    root = tmp_path / "run" / "checkpoints"
    assert one_line_error(code, err) == (
        f"checkpoint at step 3 not written: {told} on {root} (the last checkpoint, step 2, is intact; free space "
        "and resume)"
    )
    assert (root / ckpt.LATEST).read_text() == "step_2"
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, "step_1", "step_2"]  # no partial folder
    assert damage(root / "step_2", ckpt.STATE_FILE) is None

    monkeypatch.setattr(ckpt, "save_file", write)  # space freed
    code, _, err = run_cli([*common, "trainer.resume=auto"])
    assert code == 0, err
    assert (root / ckpt.LATEST).read_text() == "step_3"


def test_a_full_disk_while_pointing_latest_removes_the_new_step_and_keeps_the_old(tmp_path, monkeypatch):
    parts = tiny_parts()
    root = tmp_path / "checkpoints"
    save(root, 3, parts)
    train_once(*parts)
    replace = os.replace

    def full_on_latest(source, target):
        if Path(target).name == ckpt.LATEST:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        replace(source, target)

    monkeypatch.setattr(os, "replace", full_on_latest)
    with pytest.raises(CheckpointError) as raised:
        save(root, 4, parts)
    assert str(raised.value) == (f"checkpoint at step 4 not written: no space left on {root} (the last checkpoint, "
                                 "step 3, is intact; free space and resume)")
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, "step_3"]
    assert ckpt.latest_checkpoint(root) == root / "step_3"


def test_a_full_disk_before_any_checkpoint_says_there_is_none(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", full)
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as raised:
        save(root, 1, tiny_parts())
    assert str(raised.value) == (f"checkpoint at step 1 not written: no space left on {root} (no earlier checkpoint "
                                 "was written; free space and start again)")
    assert list(root.iterdir()) == []


def test_other_write_errors_keep_their_traceback(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(ckpt, "save_file", denied)
    with pytest.raises(PermissionError):
        save(tmp_path / "checkpoints", 1, tiny_parts())


# ----------------------------------------------------------------------------- eval and the run lock
def test_eval_refuses_a_run_folder_a_live_run_holds_and_releases_its_lock(tiny_overrides, run_cli, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [line for line in tiny_overrides(None) if not line.startswith("trainer.eval_prompts=")]
    rlhf_lab.train([*overrides, "trainer.eval_prompts=0"], run_dir=run_dir)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {line}\n" for line in overrides))
    lock = run_dir / run_lock.LOCK_FILE
    live = os.open(lock, os.O_RDWR)  # a training run still writing into the folder, PID 4242
    os.write(live, b"4242\n")
    fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        message = one_line_error(*run_cli(["eval", str(run_dir)])[::2])
        assert message == (f"run folder {str(run_dir)!r} is in use by process 4242 (lock {lock}); wait for it to "
                           "end or give --out a folder outside it")
        assert not (run_dir / "eval").exists()
        other = one_line_error(*run_cli(["eval", str(run_dir), "--out", str(run_dir / "mine")])[::2])
        assert other == message  # an --out inside the run folder is the run's too
    finally:
        os.close(live)
    code, printed, err = run_cli(["eval", str(run_dir), "eval.prompts=2"])
    assert code == 0, err
    assert len(list((run_dir / "eval").glob("*/eval.json"))) == 1
    assert not run_lock.holds(run_dir) and lock.read_text() == ""  # released: the next run takes it at once
