"""Files and folders a config names: prompt files, model and reward-model folders, hub ids in the cache.

Checked before any model loads, so a missing folder or an uncached hub id (with ``HF_HUB_OFFLINE=1``)
stops the run at once with one line.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

from rlhf_lab.data.prompts import FILE_FORMATS
from rlhf_lab.errors import ConfigError


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check_model_location(key: str, path: str, classifier: bool = False, weights: bool = True) -> None:
    """A local model folder must hold a saved model, with a readable ``config.json`` (for a ``classifier``, of a
    model with a classification head) and, unless ``weights`` is false (``rlhf-lab plan`` of a ``config.json``
    alone), safetensors weights; a hub id must be cached when the hub is offline."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
            raise ConfigError(f"{key}={path!r} has no config.json; it must be a folder written by save_pretrained")
        if (folder / "config.json").is_file():
            check_model_config(key, path, folder / "config.json", classifier)
            if weights:
                check_model_weights(key, path, folder)
        return
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ConfigError(f"{key}={path!r} is not a folder")
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ConfigError(
                f"{key}={path!r} is not a local folder, and as a hub id it is not in the local cache "
                "(HF_HUB_OFFLINE=1)"
            )


def check_model_config(key: str, path: str, config_file: Path, classifier: bool) -> None:
    """``config.json`` must read as a JSON object; a classifier's must not be a causal language model's, whose
    classification head would be made up at random."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{key}={path!r}: its config.json is unreadable ({type(error).__name__})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}={path!r}: its config.json is not a JSON object")
    if config.get("auto_map") and not _known_model_type(config.get("model_type")):
        raise ConfigError(f"{key}={path!r} needs its own Python code to load (auto_map in its config.json, "
                          f"model_type {config.get('model_type')!r} unknown to transformers); rlhf_lab runs no code "
                          "from a model folder: give a model of an architecture transformers ships")
    architectures = config.get("architectures") or []
    if classifier and architectures and all(name.endswith("ForCausalLM") for name in architectures):
        raise ConfigError(f"{key}={path!r} is a causal language model ({architectures[0]}), not a sequence "
                          "classifier: its score head would be random; give a classifier or reward model folder "
                          "(algorithm=reward_model writes one)")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_model_weights(key: str, path: str, folder: Path) -> None:
    """A model folder's weights must be safetensors: pickle files can run code when loaded, so they are refused
    by name (torch's ``weights_only`` guard would stop them with a traceback)."""
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(item.name for item in folder.iterdir() if item.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConfigError(f"{key}={path!r} holds its weights only as pickle ({pickled[0]}), which rlhf_lab never "
                          "loads; convert it once where you trust it: model.save_pretrained(folder, "
                          "safe_serialization=True)")
    raise ConfigError(f"{key}={path!r} has no weights (*.safetensors); it must be a folder written by "
                      "save_pretrained")


def check_cache() -> None:
    """``$RLHF_LAB_CACHE``, where the embedded model is unpacked, must be a folder this process can write."""
    value = os.environ.get("RLHF_LAB_CACHE")
    if not value:
        return
    folder = Path(value).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"RLHF_LAB_CACHE={value!r} is a file, not a folder; point it at a folder (or unset it)")
    try:  # made now, as loading the model would: a folder that cannot be made or written is one line here
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise ConfigError(f"RLHF_LAB_CACHE={value!r} is not writable ({error.strerror}); point it at a folder you "
                          "can write (or unset it)") from None


def check_model(model: Any, pending_paths: Collection[str] = ()) -> None:
    """``model.name_or_path``: a saved model's folder or a cached hub id (its weights not yet needed where it is in
    ``pending_paths``: written by an earlier stage, or planned from its ``config.json``)."""
    if model.name == "path" or model.name_or_path:
        path = model.name_or_path
        if path is None:
            raise ConfigError("model.name_or_path=None: model=path needs a local folder or hub id")
        if (path.startswith((".", "/", "~")) or Path(path).exists()) and not Path(path).expanduser().is_dir():
            raise ConfigError(f"model.name_or_path={path!r} is not a folder")
        check_model_location("model.name_or_path", path, weights=path not in pending_paths)


def check_data(data: Any) -> None:
    if data.name == "reasoning_gym":
        for key, minimum in (("size", 1), ("eval_size", 0)):
            if data[key] < minimum:
                raise ConfigError(f"data.{key}={data[key]} is out of range; must be >= {minimum} (examples of "
                                  f"data.task={data.task})")
    if data.name in (*FILE_FORMATS, "local") and (not data.path or not Path(data.path).expanduser().exists()):
        raise ConfigError(f"data.path={data.path!r} does not exist (data={data.name})")


def check_reward(reward: Any, pending_paths: Collection[str] = ()) -> None:
    """A reward that reads a model (``model_path`` in its schema) needs a folder or a cached hub id (unless an
    earlier stage writes it: ``pending_paths``)."""
    if "model_path" not in reward or reward.model_path in pending_paths:
        return
    path = reward.model_path
    if not path:
        raise ConfigError(f"reward.model_path={path!r}: reward={reward.name} needs a model folder or hub id")
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise ConfigError(f"reward.model_path={path!r} is not a folder")
    check_model_location("reward.model_path", path, classifier=True)


def check_paths(cfg: Any, pending_paths: Collection[str] = ()) -> None:
    check_cache()
    check_model(cfg.model, pending_paths)
    check_data(cfg.data)
    check_reward(cfg.reward, pending_paths)


def _known_model_type(model_type: Any) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING
