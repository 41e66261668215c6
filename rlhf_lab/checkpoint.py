"""Crash-safe checkpoints: ``checkpoints/step_N/`` written to a temporary folder and renamed into place.

A checkpoint holds the policy (or its LoRA adapter) via ``save_pretrained`` (safetensors), extra modules
(a value head) as safetensors, optimizer and scheduler state (``torch.save``; read back only with
``weights_only=True``), RNG states and the trainer state (step, KL controller) as JSON. The file
``checkpoints/latest`` names the newest complete checkpoint and is replaced last, so a run killed
mid-write leaves the previous checkpoint in force.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

COMPLETE_MARKER = "trainer_state.json"  # written last inside a checkpoint folder
STEP_FOLDER = re.compile(r"^step_(\d+)$")


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{index}"] = state
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    plain = {
        "python": [python_state[0], list(python_state[1]), python_state[2]],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("cuda_")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    root: Path,
    step: int,
    policy: nn.Module,
    tokenizer: Any,
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    keep_last_n: int,
) -> Path:
    """Write ``root/step_{step}`` atomically, point ``root/latest`` at it, prune old ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=root))
    try:
        policy.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        for name, module in modules.items():
            state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
            save_file(state, str(tmp / f"{name}.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        rng_tensors, rng_plain = rng_state()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        state = {"step": step, "rng": rng_plain, **trainer_state}
        with open(tmp / COMPLETE_MARKER, "w", encoding="utf-8") as handle:
            json.dump(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pointer_tmp = root / ".latest.tmp"
    pointer_tmp.write_text(final.name)
    os.replace(pointer_tmp, root / "latest")
    for old in complete_checkpoints(root)[:-keep_last_n] if keep_last_n > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (temporary or torn ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_FOLDER.match(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def is_complete(folder: Path) -> bool:
    """A checkpoint folder whose every part is present and whose state file parses."""
    try:
        json.loads((folder / COMPLETE_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (folder / "optimizer.pt").is_file() and (folder / "rng.safetensors").is_file() and (
        folder / "model"
    ).is_dir()


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names if it is complete, else the newest complete one."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def load_checkpoint(
    folder: Path,
    policy: nn.Module,
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    uses_adapter: bool,
) -> dict[str, Any]:
    """Restore everything ``save_checkpoint`` wrote into live objects; return the trainer state."""
    folder = Path(folder)
    if not is_complete(folder):
        raise FileNotFoundError(f"trainer.resume={str(folder)!r} is not a complete checkpoint folder")
    model_dir = folder / "model"
    if uses_adapter:
        from peft import set_peft_model_state_dict
        from peft.utils import SAFETENSORS_WEIGHTS_NAME

        set_peft_model_state_dict(policy, load_file(str(model_dir / SAFETENSORS_WEIGHTS_NAME)))
    else:
        state = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(str(shard)))
        missing, unexpected = policy.load_state_dict(state, strict=False)
        tied = {k for k in missing if "lm_head" in k}
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"checkpoint {folder} does not match the model: missing {missing}, extra {unexpected}")
    for name, module in modules.items():
        module.load_state_dict(load_file(str(folder / f"{name}.safetensors")))
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    state = json.loads((folder / COMPLETE_MARKER).read_text())
    set_rng_state(load_file(str(folder / "rng.safetensors")), state.pop("rng"))
    return state
