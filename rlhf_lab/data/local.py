"""``data=local``: prompts from a local file or folder in any format ``datasets`` reads, told by extension or layout.

``data.path`` may be

- a file: ``.jsonl`` / ``.json`` (JSON lines or an array of objects), ``.csv``, ``.parquet`` (verl's format);
- a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (its ``dataset_info.json`` /
  ``dataset_dict.json``): a dataset dict's splits are ``data.train_split`` / ``data.eval_split``;
- a folder of split files: ``<train_split>.<ext>`` and ``<eval_split>.<ext>`` with one of the extensions above.

Everything is read through ``datasets`` offline (its packaged builders and ``load_from_disk``). Without an eval split,
``data.eval_fraction`` of the training prompts are held out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_lab.errors import DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # extension -> datasets builder
SAVED_DATASET = "dataset_info.json"  # Dataset.save_to_disk
SAVED_DATASET_DICT = "dataset_dict.json"  # DatasetDict.save_to_disk


def root_cause(error: BaseException) -> str:
    """The innermost cause of a chained exception, on one line (datasets wraps the informative one)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``save_to_disk`` wrote (a dataset or a dataset dict)."""
    return path.is_dir() and ((path / SAVED_DATASET_DICT).is_file() or (path / SAVED_DATASET).is_file())


def builder_of(file: Path) -> str:
    """The ``datasets`` builder that reads ``file``, by its extension; another extension is a one-line DataError."""
    builder = BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise DataError(f"data.path={str(file)!r}: cannot tell its format from the extension {file.suffix!r}; "
                        f"data=local reads {', '.join(BUILDERS)} files and save_to_disk folders")
    return builder


def split_files(folder: Path, split: str) -> list[Path]:
    """The files of ``split`` in a folder of split files (``train.parquet``, ...)."""
    return sorted(p for p in folder.glob(f"{split}.*") if p.suffix.lower() in BUILDERS)


def load_local(data_cfg: Any) -> tuple[Any, Any | None, str]:
    """(train dataset, eval dataset or None, where they come from) of ``data.path`` (see the module)."""
    import datasets

    path = Path(str(data_cfg.path)).expanduser() if data_cfg.path else None
    if path is None or not path.exists():
        raise DataError(f"data.path={data_cfg.path!r} does not exist")
    train_split, eval_split = str(data_cfg.train_split), str(data_cfg.eval_split)
    if is_saved_dataset(path):
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as error:  # noqa: BLE001 (a torn or partial folder: datasets raises many types)
            raise DataError(f"cannot read {path} as a save_to_disk dataset: {root_cause(error)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if train_split not in loaded:
                raise DataError(f"data.path={str(path)!r} has no split {train_split!r} (data.train_split); "
                                f"splits: {', '.join(loaded)}")
            return _rows(loaded[train_split], path), loaded.get(eval_split), str(path)
        return _rows(loaded, path), None, str(path)
    if path.is_dir():
        train_files, eval_files = split_files(path, train_split), split_files(path, eval_split)
        if len(train_files) != 1:
            found = ", ".join(p.name for p in train_files) or "none"
            raise DataError(f"data.path={str(path)!r} needs one {train_split}.<ext> file ({', '.join(BUILDERS)}) or "
                            f"a save_to_disk dataset; found: {found}")
        files = {"train": train_files[0], **({"eval": eval_files[0]} if eval_files else {})}
    else:
        files = {"train": path}
    read = {}
    for split, file in files.items():
        try:
            read[split] = datasets.load_dataset(builder_of(file), data_files=str(file), split="train")
        except DataError:
            raise
        except Exception as error:  # noqa: BLE001 (datasets raises many types for an unreadable file)
            raise DataError(f"cannot read {file} as {builder_of(file)}: {root_cause(error)}") from None
    return _rows(read["train"], files["train"]), read.get("eval"), str(files["train"])


def _rows(dataset: Any, source: Path) -> Any:
    """``dataset``, refused in one line naming ``source`` where it holds no rows (no prompt to train on)."""
    if len(dataset) == 0:
        raise DataError(f"{source} holds no rows: no prompt to train on")
    return dataset
