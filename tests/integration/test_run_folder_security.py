"""A run folder is data, not code, and nothing outside it is written through it: a crafted stored config does not
run its code under ``rlhf-lab eval`` (unless named again or trusted), a planted lock or metrics symlink is refused
in one line with its target untouched, and a ``*.dist-info`` in the working folder injects no plug-in. Each of these
failed before the fix: the shell command ran, the target was truncated or created, the plug-in imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_lab
from tests.limits import HANG_GUARD_S

TINY = ["model=tiny", "trainer.steps=1", "trainer.eval_prompts=2", "trainer.progress_bar=false",
        "algorithm.group_size=2", "trainer.prompts_per_step=2", "trainer.max_new_tokens=4", "trainer.precision=fp32"]
PLANTED = '''
from pathlib import Path

Path({marker!r}).write_text("ran")
def score(prompts, responses):
    return [0.0] * len(responses)
'''


def test_eval_runs_no_code_named_only_by_a_run_folder(tmp_path: Path, run_cli, monkeypatch, capsys) -> None:
    run = tmp_path / "run"
    rlhf_lab.train(TINY, run_dir=run)
    capsys.readouterr()  # training's own output
    marker = tmp_path / "marker.txt"
    (tmp_path / "planted_reward.py").write_text(PLANTED.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_reward", raising=False)
    (run / ".hydra" / "overrides.yaml").write_text("".join(
        f"- {line}\n" for line in [*TINY, "reward=python", "reward.function=planted_reward:score"]))
    code, _, err = run_cli(["eval", str(run)])
    assert code == 2 and not marker.exists()
    assert err == (f"error: '{run / '.hydra' / 'overrides.yaml'}' names code to run (reward.function=planted_reward:"
                   "score); a run folder is data, so its code runs only when you name it: give reward.function=... on "
                   "the command line, or pass --trust-run-config\n")
    code, _, err = run_cli(["eval", str(run), "reward.function=planted_reward:score"])  # named by the user
    assert code == 0 and marker.read_text() == "ran", err
    marker.unlink()
    monkeypatch.delitem(sys.modules, "planted_reward")
    code, _, err = run_cli(["eval", str(run), "--trust-run-config"])
    assert code == 0 and marker.exists(), err


@pytest.mark.parametrize("name", [".rlhf_lab.lock", "metrics.jsonl", "samples.jsonl"])
def test_a_symlink_planted_in_a_run_folder_is_not_followed(tmp_path: Path, run_cli, name: str) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    existing = outside / "precious.txt"
    existing.write_text("keep me")
    target = existing if name == ".rlhf_lab.lock" else outside / f"created_{name}"  # dangling for the logs
    (run / name).symlink_to(target)
    code, _, err = run_cli([*TINY, f"trainer.output_dir={run}"])
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: '{run / name}' is a symbolic link;")
    assert existing.read_text() == "keep me" and sorted(p.name for p in outside.iterdir()) == ["precious.txt"]


def test_a_dist_info_in_the_working_folder_injects_no_plugin(tmp_path: Path) -> None:
    marker = tmp_path / "injected.txt"
    (tmp_path / "evil_plugin.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\n")
    info = tmp_path / "evil_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: evil_plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlhf_lab.plugins]\nevil = evil_plugin\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", "model=tiny", "trainer.steps=-1"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2 and "trainer.steps=-1" in result.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------ checkpoints hold only their own files
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("security") / "run"
    rlhf_lab.train(TINY, run_dir=run)
    return run


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    return run, next((run / "checkpoints").glob("step_*"))


def _sizes_only(step: Path, **files: int) -> None:
    """The checkpoint's manifest as an older save wrote it (sizes, no digests), with ``files`` added."""
    import json

    state = json.loads((step / "trainer_state.json").read_text())
    for key in ("sha256", "keys", "state_sha256"):
        state.pop(key, None)
    state["files"].update(files)
    (step / "trainer_state.json").write_text(json.dumps(state))


def test_export_copies_nothing_from_outside_the_run_folder(trained: Path, tmp_path: Path, run_cli) -> None:
    run, step = _copy(trained, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    (step / "model" / "notes.txt").symlink_to(secret)
    _sizes_only(step, **{"model/notes.txt": secret.stat().st_size})
    out = tmp_path / "out"
    code, _, err = run_cli(["export", str(run), str(out)])
    assert (code, err) == (2, f"error: checkpoint {step} is damaged (model/notes.txt is a symbolic link (a checkpoint "
                              "holds only its own files)); use another checkpoint of the run (checkpoints/step_N)\n")
    assert not out.exists()


def test_a_manifest_entry_outside_the_checkpoint_is_refused_not_followed(trained: Path, tmp_path: Path,
                                                                         run_cli) -> None:
    run, step = _copy(trained, tmp_path)
    _sizes_only(step, **{"../../../secret.txt": 11})
    (tmp_path / "secret.txt").write_text("private key")
    for command in (["eval", str(step)], ["export", str(step), str(tmp_path / "out")]):
        code, _, err = run_cli(command)
        assert code == 2 and err.count("\n") == 1, err
        assert err in (f"error: checkpoint {step} is damaged (trainer_state.json names '../../../secret.txt', outside "
                       "the checkpoint (edited)); use another checkpoint of the run (checkpoints/step_N)\n",
                       f"error: '{step}' is an incomplete checkpoint (a save was interrupted)\n"), err


def test_a_symlinked_checkpoints_folder_is_not_followed(trained: Path, tmp_path: Path, run_cli) -> None:
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(trained / ".hydra", run / ".hydra")
    (run / "checkpoints").symlink_to(trained / "checkpoints")
    for command in (["eval", str(run)], ["export", str(run), str(tmp_path / "out")]):
        code, _, err = run_cli(command)
        assert (code, err) == (2, f"error: '{run}': {run / 'checkpoints'} is a symbolic link; a run's checkpoints "
                                  "are read only from its own folder (give the folder it points to instead)\n")


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_a_named_pipe_in_a_checkpoint_blocks_no_reader(trained: Path, tmp_path: Path, command: str) -> None:
    """Before: ``eval``, ``export`` and ``trainer.resume=auto`` waited forever on the pipe (a subprocess here, so a
    hang is a failed test, not a stuck suite)."""
    run, step = _copy(trained, tmp_path)
    (step / "trainer_state.json").unlink()
    os.mkfifo(step / "trainer_state.json")
    args = {"eval": ["eval", str(run)], "export": ["export", str(run), str(tmp_path / "out")],
            "resume": [*TINY, "trainer.steps=2", f"trainer.output_dir={run}", "trainer.resume=auto"]}[command]
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", *args], capture_output=True, text=True, timeout=HANG_GUARD_S,
                            cwd=tmp_path)
    if command == "resume":  # the pipe is never opened: its checkpoint is not complete, the run goes on without it
        assert "Traceback" not in result.stderr, result.stderr
    else:
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "holds no checkpoint with a model" in result.stderr or "is not a regular file" in result.stderr


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_a_named_pipe_as_a_log_blocks_no_run(tmp_path: Path, name: str) -> None:
    """Before: opening the pipe to write (or, on resume, to read) waited for a reader forever."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / name)
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", *TINY, f"trainer.output_dir={run}"],
                            capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr == (f"error: '{run / name}' is not a regular file (a named pipe or a device); a run folder's "
                             "files are only regular files (remove it, or choose another trainer.output_dir)\n")
