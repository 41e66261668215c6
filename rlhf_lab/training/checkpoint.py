"""Crash-safe checkpoints: ``checkpoints/step_N/`` written to a temporary folder and renamed into place.

A checkpoint holds only safetensors and JSON, so loading one never unpickles anything:

- ``model/``: the policy (or its LoRA adapter) via ``save_pretrained``, and the tokenizer;
- ``<name>.safetensors``: each extra trainable module of the algorithm (``algorithm.modules()``, e.g. a
  value head);
- ``optimizer.safetensors``: the tensors of the optimizer and scheduler states; their other fields
  (hyper-parameters, step counts) are JSON inside ``trainer_state.json``. Under ``trainer.save=model``
  (:mod:`.save_policy`) it holds the scheduler only: the checkpoint evaluates and exports but cannot resume;
- ``sharded/`` (FSDP runs): the policy, the algorithm's modules and the optimizer as every rank holds them, written
  by every rank through ``torch.distributed.checkpoint`` (DCP) and read back the same way, each rank its own part
  (any process count, one process included); each rank hashes the shard files it wrote. No rank gathers the whole
  state: ``model/`` (the gathered weights, as an unsharded run writes them) is written only by the run's last save,
  the others keep the tokenizer in ``tokenizer/`` and ``rlhf-lab export`` turns their shards into a Hugging Face
  folder; ``optimizer.safetensors`` holds the scheduler only;
- ``rng.safetensors``: the torch (and CUDA) generator states; Python's and NumPy's are JSON;
- ``config.json``: the resolved config of the run that wrote it (what a resume is compared against);
- ``trainer_state.json``: ``step`` (the last step trained, 0-based: ``step_N`` holds N updates and its ``step``
  is N - 1), KL controller, counters, the seconds trained so far (``train_seconds``, the
  clock of ``trainer.max_train_seconds``), and a manifest of every file above with its
  size and sha256 (:mod:`.verify`). It is written last, so a folder whose manifest is missing, unreadable or
  does not match the files is incomplete and never loaded; a resume verifies the digests too.

Write order: files -> fsync -> ``trainer_state.json`` -> rename the temporary ``.step_N.*`` folder to
``step_N`` -> replace the ``latest`` pointer. A run killed at any point leaves the previous checkpoint
loadable; leftover temporary folders are removed by the next save. A full disk (or quota) is one line
(:class:`CheckpointError`) once the partial folder is removed: the previous checkpoint and ``latest`` stay as
they were.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from rlhf_lab.errors import CheckpointError
from rlhf_lab.training.checkpoint_find import (  # noqa: F401  (the layout's names and the finders, used as ckpt.X)
    COMPLETE_MARKER,
    CONFIG_FILE,
    LATEST,
    MODEL_FOLDER,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    STEP_FOLDER,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    locate_checkpoint,
    prepare_run_folder,
    read_state,
    refuse_model_only,
    resolve_resume,
    run_folder_of,
    updates_held,
)
from rlhf_lab.training.checkpoint_sharded import (  # noqa: F401
    SHARDED_FOLDER,
    TOKENIZER_FOLDER,
    load_sharded,
    own_shard_digests,
    save_sharded,
)
from rlhf_lab.training.state_encoding import decode_state, encode_state, rng_state, set_rng_state
from rlhf_lab.training.verify import fsync, fsync_tree, full_disk, manifest, seal

TEMP_PREFIX = ".step_"


# ----------------------------------------------------------------------------- save
def remove_temporary(root: Path, keep: Path | None = None) -> None:
    """Delete ``.step_*`` folders left by a save that was killed (rank 0 does; ``keep``: the one being written)."""
    for child in Path(root).glob(f"{TEMP_PREFIX}*"):
        if child.is_dir() and child != keep:
            shutil.rmtree(child, ignore_errors=True)


def staging_folder(root: Path, updates: int) -> Path:
    """The temporary folder every rank writes the sharded checkpoint ``step_{updates}`` into (one name on all ranks)."""
    return Path(root) / f"{TEMP_PREFIX}{updates}.sharded"


def prepare_staging(root: Path, updates: int) -> Path:
    """Rank 0, before the ranks write: an empty staging folder (a killed save's leftovers removed)."""
    folder = staging_folder(root, updates)
    Path(root).mkdir(parents=True, exist_ok=True)
    remove_temporary(root)
    folder.mkdir()
    return folder


@contextmanager
def refusing_full_disk(root: Path, step: int, partial: tuple[Path, ...] = ()) -> Iterator[None]:
    """A write of checkpoint ``step`` that finds the disk full becomes one-line :class:`CheckpointError`, once
    the ``partial`` files and folders it left are removed (the earlier checkpoints are untouched)."""
    try:
        yield
    except (OSError, SafetensorError) as error:
        told = full_disk(error)
        if told is None:
            raise
        for path in partial:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        last = latest_checkpoint(root)
        intact = (f"the last checkpoint, step {last.name.removeprefix('step_')}, is intact; free space and resume"
                  if last is not None else "no earlier checkpoint was written; free space and start again")
        raise CheckpointError(f"checkpoint at step {step} not written: {told} on {root} ({intact})") from None


def save_checkpoint(
    root: Path,
    updates: int,
    policy: nn.Module,
    tokenizer: Any,
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    keep_last_n: int,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    module_states: dict[str, dict[str, torch.Tensor]] | None = None,
    config: dict[str, Any] | None = None,
    staged: Path | None = None,
    tensor_files: dict[str, dict[str, torch.Tensor]] | None = None,
    with_optimizer: bool = True,
    shard_digests: dict[str, str] | None = None,
) -> Path:
    """Write ``root/step_{updates}`` (the policy after ``updates`` optimizer updates) atomically, point
    ``root/latest`` at it, keep the newest ``keep_last_n``.

    ``model_state`` / ``module_states``: the whole states gathered from sharded (FSDP) modules (``model/`` is
    written from them as an unsharded run writes it). ``staged``: the staging folder the ranks wrote the sharded
    state into (:func:`save_sharded`); the optimizer's state is there, and the rest is written beside it.
    ``shard_digests``: the sha256 of every rank's shard files, each computed by the rank that wrote them (rank 0
    hashes only its own and the small common files). Without ``model_state`` a staged checkpoint holds the weights as
    shards only (no ``model/``; the tokenizer in ``tokenizer/``).
    ``tensor_files``: further safetensors files by name (the batch generated ahead, :mod:`.ahead`).
    ``with_optimizer=False`` (``trainer.save=model``): no optimizer state, the model and the run's small state only.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_temporary(root, keep=staged)
    final = root / f"step_{updates}"
    with refusing_full_disk(root, updates):  # the temporary folder is removed either way
        tmp = staged or Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{updates}.", dir=root))
        try:
            if staged is None or model_state is not None:  # else the weights are the shards alone
                policy.save_pretrained(tmp / MODEL_FOLDER, safe_serialization=True, state_dict=model_state)
                tokenizer.save_pretrained(tmp / MODEL_FOLDER)
            else:
                tokenizer.save_pretrained(tmp / TOKENIZER_FOLDER)
            for name, module in modules.items():
                if staged is not None and module_states is None:  # in the shards
                    continue
                whole = (module_states or {}).get(name) or module.state_dict()
                state = {k: v.detach().contiguous() for k, v in whole.items()}
                save_file(state, str(tmp / f"{name}.safetensors"))
            optimizer_tensors: dict[str, torch.Tensor] = {}
            states = {"scheduler": scheduler.state_dict()}
            if staged is None and with_optimizer:  # else in the sharded folder, or not kept
                states["optimizer"] = optimizer_state or optimizer.state_dict()
            optimizer_plain = encode_state(states, optimizer_tensors)
            save_file(optimizer_tensors, str(tmp / OPTIMIZER_FILE))
            for name, tensors in (tensor_files or {}).items():
                save_file(tensors, str(tmp / name))
            rng_tensors, rng_plain = rng_state()
            save_file(rng_tensors, str(tmp / RNG_FILE))
            if config is not None:
                (tmp / CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")
            fsync_tree(tmp)
            state = {
                "step": updates - 1,  # the last step trained: a resume continues at step + 1
                **trainer_state,
                "optimizer": optimizer_plain,
                "rng": rng_plain,
                "modules": sorted(modules),
                "optimizer_saved": with_optimizer,
                "files": manifest(tmp, skip=STATE_FILE),
            }
            state = seal(state, tmp, skip=STATE_FILE, known=shard_digests)  # each rank hashed its own shards
            with open(tmp / STATE_FILE, "w", encoding="utf-8") as handle:
                json.dump(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            if final.exists():  # the same step saved again (a re-run); the pointer still names a complete one
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    pointer_tmp = root / f".{LATEST}.tmp"
    with refusing_full_disk(root, updates, (pointer_tmp, final)):  # `latest` keeps naming the previous checkpoint
        with open(pointer_tmp, "w", encoding="utf-8") as handle:
            handle.write(final.name)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(pointer_tmp, root / LATEST)
    fsync(root)
    if keep_last_n > 0:
        for old in complete_checkpoints(root)[:-keep_last_n]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of a checkpoint, or nothing where it has none."""
    return load_file(str(path)) if Path(path).is_file() else {}


# ----------------------------------------------------------------------------- load
def load_policy_weights(folder: Path, policy: nn.Module, uses_adapter: bool, sharded: bool = False) -> None:
    """The policy's weights of checkpoint ``folder`` into ``policy``: its LoRA adapter, or its full weights
    (an LM head tied to the embeddings may be absent); a mismatch is one-line :class:`CheckpointError`."""
    model_dir = Path(folder) / MODEL_FOLDER
    if uses_adapter:
        from peft import set_peft_model_state_dict
        from peft.utils import SAFETENSORS_WEIGHTS_NAME

        set_peft_model_state_dict(policy, load_file(str(model_dir / SAFETENSORS_WEIGHTS_NAME)))
        return
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    if sharded:
        from rlhf_lab.runtime.distributed import load_full_model_state

        missing, unexpected = load_full_model_state(policy, weights)
    else:
        missing, unexpected = policy.load_state_dict(weights, strict=False)
    tied = {k for k in missing if "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


def load_checkpoint(
    folder: Path,
    policy: nn.Module,
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    uses_adapter: bool,
    sharded: bool = False,
) -> dict[str, Any]:
    """Restore everything :func:`save_checkpoint` wrote into live objects; return the trainer state.

    ``sharded``: the policy, modules and optimizer are FSDP-sharded; the whole states are loaded into them.

    Only safetensors and JSON are read. A checkpoint that does not fit the configured run (another model
    size, LoRA on/off, another algorithm's modules) raises :class:`CheckpointError`.
    """
    folder = Path(folder)
    if not is_complete(folder):
        raise CheckpointError(f"trainer.resume={str(folder)!r} is not a complete checkpoint folder")
    state = read_state(folder)
    model_dir = folder / MODEL_FOLDER
    has_adapter = (model_dir / "adapter_config.json").is_file()
    if has_adapter != uses_adapter:
        saved, wanted = ("a LoRA adapter", "true") if has_adapter else ("full weights", "false")
        raise CheckpointError(f"checkpoint {folder} holds {saved} but model.lora.enabled is not {wanted}")
    refuse_model_only(folder, state)
    missing_modules = sorted(set(modules) - set(state.get("modules", [])))
    if missing_modules:
        raise CheckpointError(
            f"checkpoint {folder} has no {', '.join(missing_modules)} (it was written by another algorithm)"
        )
    try:
        if (folder / SHARDED_FOLDER).is_dir():  # written by an FSDP run: each rank reads its part
            load_sharded(folder, policy, modules, optimizer)
            scheduler.load_state_dict(decode_state(state.pop("optimizer"), load_file(str(folder / OPTIMIZER_FILE)))
                                      ["scheduler"])
            return _finish_load(folder, state)
        load_policy_weights(folder, policy, uses_adapter, sharded)
        for name, module in modules.items():
            module_state = load_file(str(folder / f"{name}.safetensors"))
            if sharded:
                from rlhf_lab.runtime.distributed import load_full_model_state

                load_full_model_state(module, module_state)
            else:
                module.load_state_dict(module_state)
        plain = decode_state(state.pop("optimizer"), load_file(str(folder / OPTIMIZER_FILE)))
        if sharded:
            from rlhf_lab.runtime.distributed import load_full_optimizer_state

            load_full_optimizer_state({"policy": policy, **modules}, optimizer, plain["optimizer"])
        else:
            optimizer.load_state_dict(plain["optimizer"])
        scheduler.load_state_dict(plain["scheduler"])
    except CheckpointError:
        raise
    except SafetensorError as error:  # a checkpoint without digests (an older save) with a damaged file
        raise CheckpointError(f"checkpoint {folder} has an unreadable safetensors file: {error}") from None
    except RuntimeError as error:  # shape mismatches from load_state_dict
        first = str(error).strip().splitlines()
        detail = next((line.strip() for line in first[1:] if line.strip()), first[0] if first else "")
        raise CheckpointError(f"checkpoint {folder} does not match the configured model: {detail}") from None
    except ValueError as error:  # e.g. an optimizer with other parameter groups
        raise CheckpointError(f"checkpoint {folder} does not match the configured run: {error}") from None
    return _finish_load(folder, state)


def _finish_load(folder: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The generators restored; the trainer's state without the checkpoint's bookkeeping."""
    try:
        set_rng_state(load_file(str(folder / RNG_FILE)), state.pop("rng"))
    except (SafetensorError, KeyError, TypeError, ValueError, RuntimeError) as error:  # an older save without digests
        raise CheckpointError(f"checkpoint {folder} has an unreadable {RNG_FILE} ({type(error).__name__}); use "
                              "another checkpoint of the run (checkpoints/step_N)") from None
    for key in ("files", "modules", "sha256", "keys", "state_sha256", "optimizer_saved"):
        state.pop(key, None)
    return state
