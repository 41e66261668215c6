"""Prompt sets: the embedded ``movie_prompts``, local jsonl/csv files or folders, and hub datasets.

Every source is loaded with ``datasets`` and reduced to two lists of prompt strings (train, eval).
The order prompts are drawn in is a pure function of (seed, step), so a resumed run sees the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EMBEDDED = {"movie_prompts": Path(__file__).parent / "assets" / "movie_prompts"}
FILE_FORMATS = {"jsonl": ("json", ".jsonl"), "csv": ("csv", ".csv")}


class DataError(ValueError):
    """A prompt source that cannot be used; the message names it."""


@dataclass
class PromptSplits:
    train: list[str]
    eval: list[str]


def _column(dataset: Any, column: str, where: str) -> list[str]:
    if column not in dataset.column_names:
        raise DataError(f"data.prompt_column={column!r} is not a column of {where}; columns: {dataset.column_names}")
    prompts = [str(p) for p in dataset[column]]
    empty = [i for i, p in enumerate(prompts) if not p.strip()]
    if empty:
        raise DataError(f"prompt {empty[0]} of {where} is empty")
    return prompts


def _split_off_eval(prompts: list[str], fraction: float, seed: int) -> PromptSplits:
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(fraction * len(prompts)))
    return PromptSplits(train=[prompts[i] for i in order[n_eval:]], eval=[prompts[i] for i in order[:n_eval]])


def _load_files(data_cfg: Any, builder: str, suffix: str, seed: int) -> PromptSplits:
    from datasets import load_dataset

    path = Path(data_cfg.path) if data_cfg.path else None
    if path is None or not path.exists():
        raise DataError(f"data.path={data_cfg.path!r} does not exist")
    if path.is_dir():
        files = {split: path / f"{name}{suffix}" for split, name in
                 (("train", data_cfg.train_split), ("eval", data_cfg.eval_split))}
        if not files["train"].is_file():
            raise DataError(f"data.path={str(path)!r} has no {files['train'].name}")
        if not files["eval"].is_file():
            if data_cfg.eval_fraction <= 0:
                raise DataError(f"data.path={str(path)!r} has no {files['eval'].name}; set data.eval_fraction")
            files.pop("eval")
    else:
        files = {"train": path}
    loaded = load_dataset(builder, data_files={k: str(v) for k, v in files.items()})
    train = _column(loaded["train"], data_cfg.prompt_column, str(files["train"]))
    if "eval" in files:
        return PromptSplits(train=train, eval=_column(loaded["eval"], data_cfg.prompt_column, str(files["eval"])))
    if data_cfg.eval_fraction <= 0:
        return PromptSplits(train=train, eval=[])
    return _split_off_eval(train, data_cfg.eval_fraction, seed)


def load_prompts(data_cfg: Any, seed: int = 0) -> PromptSplits:
    """Train and eval prompt lists for ``data_cfg`` (``name``: movie_prompts | jsonl | csv | hub)."""
    if data_cfg.name in EMBEDDED:
        folder = EMBEDDED[data_cfg.name]
        splits = _load_files(_with_path(data_cfg, folder), "json", ".jsonl", seed)
    elif data_cfg.name in FILE_FORMATS:
        builder, suffix = FILE_FORMATS[data_cfg.name]
        splits = _load_files(data_cfg, builder, suffix, seed)
    elif data_cfg.name == "hub":
        from datasets import load_dataset

        train = _column(load_dataset(data_cfg.path, split=data_cfg.train_split), data_cfg.prompt_column,
                        f"{data_cfg.path}[{data_cfg.train_split}]")
        evaluation = _column(load_dataset(data_cfg.path, split=data_cfg.eval_split), data_cfg.prompt_column,
                             f"{data_cfg.path}[{data_cfg.eval_split}]")
        splits = PromptSplits(train=train, eval=evaluation)
    else:
        valid = sorted([*EMBEDDED, *FILE_FORMATS, "hub"])
        raise DataError(f"data={data_cfg.name!r} is not a prompt source; valid: {', '.join(valid)}")
    if not splits.train:
        raise DataError(f"data={data_cfg.name!r} has no training prompts")
    return splits


def _with_path(data_cfg: Any, folder: Path) -> Any:
    from omegaconf import OmegaConf

    merged = OmegaConf.create(OmegaConf.to_container(data_cfg, resolve=True)) if not isinstance(data_cfg, dict) \
        else OmegaConf.create(dict(data_cfg))
    merged.path = str(folder)
    return merged


def prompt_indices(step: int, prompts_per_step: int, n_prompts: int, seed: int, rank: int = 0,
                   world_size: int = 1) -> list[int]:
    """Indices of the prompts for ``step``: consecutive slices of per-epoch seeded permutations.

    A pure function of its arguments, so resuming at any step draws the same prompts; with several
    ranks each takes every ``world_size``-th of the step's prompts (the one place prompts are sharded).
    """
    indices = []
    start = step * prompts_per_step
    for position in range(start, start + prompts_per_step):
        epoch, offset = divmod(position, n_prompts)
        order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        indices.append(int(order[offset]))
    return indices[rank::world_size]
