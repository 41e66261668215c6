"""Finding a run's checkpoints: which ``step_N`` folders are complete, which one ``trainer.resume`` names, and the
layout's names (:mod:`rlhf_lab.training.checkpoint` writes and loads them).

Nothing here follows a checkpoint out of its folder: a state file is read only if it is a regular file (a named
pipe would block), a manifest entry outside the folder makes a checkpoint incomplete, a symbolic link in place of
a run's ``checkpoints/`` is refused, and a newer checkpoint passed over is named in a warning line.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from rlhf_lab.errors import CheckpointError
from rlhf_lab.training.verify import outside_entry, read_regular_text

STATE_FILE = "trainer_state.json"  # written last inside a checkpoint folder; holds the manifest
COMPLETE_MARKER = STATE_FILE
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
CONFIG_FILE = "config.json"
MODEL_FOLDER = "model"
LATEST = "latest"
STEP_FOLDER = re.compile(r"^step_(\d+)$")


def read_state(folder: Path) -> dict[str, Any] | None:
    """The parsed ``trainer_state.json`` of a checkpoint folder, or None if missing or torn."""
    try:
        state = json.loads(read_regular_text(Path(folder) / STATE_FILE))  # never blocks on a named pipe
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def updates_held(folder: Path) -> int:
    """The optimizer updates checkpoint ``folder`` holds: its last trained step + 1, whatever the folder is called
    (checkpoints written before folders were named by their updates are called ``step_<last step>``); without a
    readable state, the N of its name ``step_N``."""
    state = read_state(folder)
    if state is not None and isinstance(state.get("step"), int):
        return state["step"] + 1
    match = STEP_FOLDER.match(Path(folder).name)
    return int(match.group(1)) if match else 0


def is_complete(folder: Path) -> bool:
    """A checkpoint folder whose state file parses and whose every file in its manifest is there, whole."""
    folder = Path(folder)
    state = read_state(folder)
    if state is None or not isinstance(state.get("files"), dict) or "step" not in state:
        return False
    files = state["files"]
    weights = (f"{MODEL_FOLDER}/", "sharded/")  # the whole model, or an FSDP run's shards
    if not {OPTIMIZER_FILE, RNG_FILE} <= files.keys() or not any(f.startswith(weights) for f in files):
        return False
    for relative, size in state["files"].items():
        path = folder / relative
        if outside_entry(relative):
            return False
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete ``step_N`` folders under ``root``, oldest first (temporary or torn ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_FOLDER.match(child.name)
        if match and child.is_dir() and not child.is_symlink() and is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names if it is complete, else the newest complete one, else None."""
    root = Path(root)
    pointer = root / LATEST
    try:
        named = root / read_regular_text(pointer).strip()
    except (OSError, UnicodeDecodeError):
        named = None
    inside = named is not None and named.resolve().parent == root.resolve()  # never followed out of root
    if inside and STEP_FOLDER.match(named.name) and is_complete(named):
        return named
    complete = complete_checkpoints(root)
    found = complete[-1] if complete else None
    _warn_skipped(root, found)
    return found


_WARNED: set[Path] = set()  # checkpoints already named in a warning by this process


def _warn_skipped(root: Path, found: Path | None) -> None:
    """A ``step_N`` newer than the checkpoint used that is not complete (a file torn, cut short or removed) is
    named in one warning line, as a damaged checkpoint the digests catch is: never passed over in silence."""
    from rlhf_lab.training.verify import damage

    def number(path: Path) -> int:
        return int(STEP_FOLDER.match(path.name).group(1))

    if found is None:  # nothing to fall back to: the caller says so in its own line
        return
    skipped = sorted((child for child in root.iterdir() if STEP_FOLDER.match(child.name) and child.is_dir()
                      and number(child) > number(found)), key=number)
    if skipped and skipped[-1] not in _WARNED:
        _WARNED.add(skipped[-1])
        problem = damage(skipped[-1], STATE_FILE) or "incomplete"
        print(f"warning: checkpoint {skipped[-1]} is damaged ({problem}); falling back to {found} (step "
              f"{number(found)})", file=sys.stderr, flush=True)


def prepare_run_folder(resume: str | None, run_dir: Path, clear_logs: bool = True,
                       overwrite: bool = False) -> Path | None:
    """The checkpoint a run in ``run_dir`` resumes from (see :func:`resolve_resume`), or None to start fresh.

    A fresh start never mixes with an earlier run's files, and never replaces a finished run's: it refuses a folder
    that holds a complete checkpoint unless asked to resume (``trainer.resume=auto``), refuses one that holds a
    finished run's ``summary.json`` (a ``trainer.save=none`` run keeps no checkpoint: its summary and metrics are
    all it has), and (``clear_logs``) empties the ``metrics.jsonl``/``samples.jsonl`` left by a run that died before
    its first checkpoint. ``overwrite`` (``trainer.overwrite=true``): the earlier run's checkpoints, summary and
    logs are removed and the run starts fresh.
    """
    from rlhf_lab.trackers.jsonl import SUMMARY_FILE, repair_jsonl

    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if overwrite and not resume:
        replaced = [path for path in (root, run_dir / SUMMARY_FILE) if path.exists()]
        if replaced and clear_logs:
            print(f"trainer.overwrite=true: replacing the run in {run_dir}")
            shutil.rmtree(root, ignore_errors=True)
            (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    folder = resolve_resume(resume, root)
    if folder is not None:
        return folder
    if not resume and latest_checkpoint(root) is not None:
        raise CheckpointError(
            f"run folder {str(run_dir)!r} already holds checkpoints; continue it with trainer.resume=auto, choose "
            "another trainer.output_dir, or replace it with trainer.overwrite=true"
        )
    if (run_dir / SUMMARY_FILE).is_file():
        raise CheckpointError(
            f"run folder {str(run_dir)!r} holds a finished run (its {SUMMARY_FILE}{' and no checkpoint' if resume else ''}"
            f"): a new run would replace its {SUMMARY_FILE} and metrics.jsonl; choose another trainer.output_dir "
            "(or hydra.run.dir), or replace it with trainer.overwrite=true"
        )
    if resume == "auto":
        print(f"trainer.resume=auto: no checkpoint in {root}, starting fresh")
    if clear_logs:
        for name in ("metrics.jsonl", "samples.jsonl"):
            repair_jsonl(run_dir / name, before_step=0)
    return None


def run_folder_of(resume: str | Path) -> Path | None:
    """The run folder a resume path belongs to: ``RUN``, ``RUN/checkpoints`` or ``RUN/checkpoints/step_N``."""
    path = Path(resume).expanduser()
    if STEP_FOLDER.match(path.name) and path.parent.name == "checkpoints":
        return path.parent.parent
    if path.name == "checkpoints" and path.is_dir():
        return path.parent
    if (path / "checkpoints").is_dir():
        return path
    return None


def locate_checkpoint(path: Path, label: str) -> Path | None:
    """The complete checkpoint an existing ``path`` names: a ``checkpoints/step_N`` folder itself, else the
    latest complete one under ``path`` or ``path/checkpoints`` (a run folder); None when it holds none.
    An interrupted ``step_N`` is a one-line :class:`CheckpointError` naming ``label``."""
    if STEP_FOLDER.match(path.name) or read_state(path) is not None:
        if not is_complete(path):
            raise CheckpointError(f"{label} is an incomplete checkpoint (a save was interrupted)")
        return path
    for root in (path, path / "checkpoints"):
        if root.is_symlink():  # a run's checkpoints are its own folder, never followed elsewhere
            raise CheckpointError(f"{label}: {root} is a symbolic link; a run's checkpoints are read only from its "
                                  "own folder (give the folder it points to instead)")
        found = latest_checkpoint(root)
        if found is not None:
            return found
    return None


def refuse_model_only(folder: Path, state: dict[str, Any] | None = None) -> None:
    """A checkpoint written under ``trainer.save=model`` (no optimizer state) cannot resume: one line saying so."""
    state = read_state(folder) if state is None else state
    if state is not None and state.get("optimizer_saved") is False:
        weights = Path(folder) / MODEL_FOLDER
        start = (f"model=path model.name_or_path={weights}" if weights.is_dir() else  # an FSDP checkpoint: shards only
                 f"rlhf-lab export {folder} OUT, then model=path model.name_or_path=OUT")
        raise CheckpointError(f"checkpoint {folder} holds the model only (written under trainer.save=model): it "
                              "evaluates and exports but cannot resume training; resume from a checkpoint written "
                              f"under trainer.save=all, or start a new run from its weights ({start})")


def resolve_resume(resume: str | None, checkpoint_root: Path) -> Path | None:
    """The checkpoint folder ``trainer.resume`` names, or None for a fresh start.

    ``null``: fresh. ``auto``: the latest complete checkpoint under ``checkpoint_root``, fresh if there is
    none. A path: a checkpoint folder, a ``checkpoints`` folder or a run folder; it must hold a complete
    checkpoint (:class:`CheckpointError` otherwise).
    """
    if not resume:
        return None
    if resume == "auto":
        latest = latest_checkpoint(checkpoint_root)
        if latest is not None:
            refuse_model_only(latest)
        return latest
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"trainer.resume={resume!r} does not exist; give a checkpoint or run folder, or auto")
    found = locate_checkpoint(path, f"trainer.resume={resume!r}")
    if found is not None:
        refuse_model_only(found)
        return found
    raise CheckpointError(
        f"trainer.resume={resume!r} holds no complete checkpoint; give a checkpoints/step_N folder, "
        "a run folder, or auto"
    )
