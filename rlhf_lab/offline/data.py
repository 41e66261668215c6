"""Offline examples: preference pairs and demonstrations from jsonl/csv files or folders and hub datasets.

A row's prompt and responses are plain text or chat messages (TRL's conversational format): ``prompt`` a
list of messages and ``chosen``/``rejected`` a one-message assistant list, or the whole conversation in
``chosen``/``rejected`` with the prompt implicit (every message before the last assistant one). Each example
keeps its prompt as messages and its responses as text; the tokenizer's chat template renders them later.

Files are UTF-8 (a byte-order mark is dropped); a jsonl file may also hold one JSON array of row objects.
Pairs with an empty or identical chosen/rejected response (and empty demonstrations) are reported with their
index and reason, then dropped (``data.on_invalid=drop``) or rejected (``error``). A malformed file fails with
one line naming the file and the line or row: a line that is not UTF-8, JSON or a row, a CSV row with another
number of fields than its header, a missing column, a value that is neither text nor chat messages (an object,
a number, a list of strings) or a margin that is not a finite number.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_lab.data.prompts import JSON_TYPES, text_lines
from rlhf_lab.data.rows import messages_problem
from rlhf_lab.errors import DataError

FORMATS = ("auto", "jsonl", "csv", "hub")
ON_INVALID = ("drop", "error")
SUFFIXES = {"jsonl": ".jsonl", "csv": ".csv"}
REPORTED = 5  # invalid rows listed one by one; the rest are counted
CSV_FIELD_LIMIT = 2**31 - 1  # a long response is valid data: csv's default refuses fields past 131,072 characters


@dataclass
class Example:
    """One preference pair (``rejected`` set) or demonstration (``rejected`` None)."""

    prompt: list[dict[str, str]]  # chat messages before the response
    chosen: str  # the preferred response, or the demonstration's response
    rejected: str | None = None
    margin: float | None = None

    @property
    def prompt_text(self) -> str | None:
        """The prompt as one user message's text (what generation is asked), None for a multi-turn prompt."""
        turns = [m for m in self.prompt if m.get("role") != "system"]
        return turns[0]["content"] if len(turns) == 1 and turns[0].get("role") == "user" else None


@dataclass
class ExampleSplits:
    train: list[Example]
    eval: list[Example]

    def held_out_prompts(self) -> list[str]:
        """Distinct single-turn eval prompts, in order: the yardstick's generation prompts."""
        return list(dict.fromkeys(p for p in (e.prompt_text for e in self.eval) if p is not None))

    def train_prompts(self) -> list[str]:
        return list(dict.fromkeys(p for p in (e.prompt_text for e in self.train) if p is not None))


# ----------------------------------------------------------------------------------------- reading rows
class RowError(ValueError):
    """A value of a row that cannot be used; :func:`to_examples` names the row and the file."""


def describe(value: Any) -> str:
    """A bad value as a message shows it: ``42 (a number)``, ``'abc'``, ``an object``."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return repr(value[:40])
    return f"{json.dumps(value, default=str)[:40]} ({JSON_TYPES.get(type(value), type(value).__name__)})"


def read_rows(path: Path, fmt: str) -> list[dict[str, Any]]:
    """Rows of a jsonl (or JSON array) or csv file as dicts, in file order."""
    lines = text_lines(path)
    return _csv_rows(path, lines) if fmt == "csv" else _json_rows(path, list(lines))


def _json_rows(path: Path, lines: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """One object per line, or one JSON array of objects (as ``json.dump(rows)`` writes)."""
    if next((line for _, line in lines if line.strip()), "").lstrip().startswith("["):
        rows = _json_array(path, "".join(line for _, line in lines))
        if rows is not None:
            return rows
    return [_json_line(path, number, line) for number, line in lines if line.strip()]


def _json_array(path: Path, text: str) -> list[dict[str, Any]] | None:
    """The rows of a file that is one JSON array; None if it holds several values (lines, read one by one)."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":
            return None
        raise DataError(f"{path}:{error.lineno} is not JSON: {error.msg}") from None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: item {index} of its JSON array is {describe(row)}, not an object of a row's "
                            "columns")
    return rows


def _json_line(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{number} is not JSON: {error.msg}") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number} is {describe(row)}, not a JSON object of a row's columns (one per line)")
    return row


def _csv_rows(path: Path, lines: Iterable[tuple[int, str]]) -> list[dict[str, Any]]:
    """Rows under the header; a row with more or fewer fields than the header (an unquoted comma) is refused."""
    limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    reader = csv.reader(line for _, line in lines)
    try:
        header = next(reader, [])
        rows = []
        for fields in reader:
            if not fields:  # a blank line
                continue
            if len(fields) != len(header):
                raise DataError(f"{path}:{reader.line_num} has {len(fields)} fields, the header has {len(header)} "
                                f"({', '.join(header)}); quote a field that holds a comma")
            rows.append(dict(zip(header, fields)))
    except csv.Error as error:
        raise DataError(f"{path}:{reader.line_num} is not valid CSV: {error}") from None
    finally:
        csv.field_size_limit(limit)
    return rows


def resolve_format(data_cfg: Any) -> str:
    fmt = data_cfg.format
    if fmt != "auto":
        return fmt
    path = Path(str(data_cfg.path)).expanduser()
    if path.is_dir():
        return "csv" if (path / f"{data_cfg.train_split}.csv").is_file() else "jsonl"
    if path.suffix in (".csv", ".jsonl", ".json"):
        return "csv" if path.suffix == ".csv" else "jsonl"
    if path.exists():
        raise DataError(f"data.path={data_cfg.path!r}: cannot tell its format; set data.format=jsonl or csv")
    return "hub"


def load_raw_splits(data_cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str, str]:
    """(train rows, eval rows or None, where train came from, where eval came from)."""
    if not data_cfg.path:
        raise DataError(f"data={data_cfg.name} needs data.path (a jsonl/csv file or folder, or a hub dataset id)")
    fmt = resolve_format(data_cfg)
    if fmt == "hub":
        return _hub_rows(data_cfg)
    path = Path(str(data_cfg.path)).expanduser()
    if not path.exists():
        raise DataError(f"data.path={data_cfg.path!r} does not exist")
    if path.is_file():
        return read_rows(path, fmt), None, str(path), ""
    suffix = SUFFIXES[fmt]
    train_file, eval_file = path / f"{data_cfg.train_split}{suffix}", path / f"{data_cfg.eval_split}{suffix}"
    if not train_file.is_file():
        raise DataError(f"data.path={str(path)!r} has no {train_file.name}")
    eval_rows = read_rows(eval_file, fmt) if eval_file.is_file() else None
    return read_rows(train_file, fmt), eval_rows, str(train_file), str(eval_file)


def _hub_rows(data_cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str, str]:
    from datasets import load_dataset

    from rlhf_lab.data.prompts import _root_cause

    splits = []
    for split in (data_cfg.train_split, data_cfg.eval_split):
        try:
            splits.append(list(load_dataset(data_cfg.path, split=split)))
        except ValueError as error:  # an unknown split: carve eval out of train
            if split == data_cfg.train_split or "split" not in str(error).lower():
                raise DataError(f"data.path={data_cfg.path!r}[{split}]: {_root_cause(error)}") from None
            splits.append(None)
        except Exception as error:  # noqa: BLE001 (offline, unknown dataset)
            raise DataError(f"data.path={data_cfg.path!r}: cannot load the hub dataset: {_root_cause(error)}") from None
    return splits[0], splits[1], f"{data_cfg.path}[{data_cfg.train_split}]", f"{data_cfg.path}[{data_cfg.eval_split}]"


# ----------------------------------------------------------------------------------------- rows -> examples
def _column(row: dict[str, Any], column: str, key: str, where: str, columns: list[str]) -> Any:
    if column not in row:
        raise DataError(f"column {column!r} ({key}) is missing from {where}; columns: {', '.join(columns)}")
    return row[column]


def messages_of(value: Any, column: str) -> list[dict[str, str]]:
    """A list of chat messages (``{"role", "content"}`` with a known role), else a RowError naming ``column``."""
    if not isinstance(value, list):
        raise RowError(f"column {column!r} is {describe(value)}, not text or chat messages")
    problem = messages_problem(value) if value else None
    if problem is not None:
        raise RowError(f"column {column!r} is a list but {problem}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def as_messages(value: Any, column: str = "prompt") -> list[dict[str, str]]:
    """A prompt value as chat messages: text becomes one user message."""
    if value is None or isinstance(value, str):
        return [{"role": "user", "content": value or ""}]
    return messages_of(value, column)


def split_response(value: Any, column: str = "chosen") -> tuple[list[dict[str, str]], str]:
    """(implicit prompt messages, response text) of a response value: text, or messages ending with the reply."""
    if value is None or isinstance(value, str):
        return [], value or ""
    messages = messages_of(value, column)
    if not messages or messages[-1]["role"] != "assistant":
        return messages, ""
    return messages[:-1], messages[-1]["content"]


def margin_of(value: Any, column: str) -> float | None:
    """A pair's margin: a finite number (or its text, from a csv file); empty is none."""
    if value is None or value == "":
        return None
    try:
        margin = float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else math.nan
    except ValueError:
        margin = math.nan
    if not math.isfinite(margin):
        raise RowError(f"column {column!r} (data.margin_column) is {describe(value)}, not a finite number")
    return margin


def pair_problem(example: Example) -> str | None:
    """Why a pair cannot train (empty or identical responses), or None."""
    if not example.chosen.strip():
        return "empty chosen response"
    if example.rejected is None or not example.rejected.strip():
        return "empty rejected response"
    if example.chosen == example.rejected:
        return "identical chosen and rejected responses"
    return None


def demonstration_problem(example: Example) -> str | None:
    return None if example.chosen.strip() else "empty response"


def to_pair(row: dict[str, Any], data_cfg: Any, where: str, columns: list[str]) -> Example:
    chosen_column, rejected_column = data_cfg.chosen_column, data_cfg.rejected_column
    prompt_column = data_cfg.prompt_column
    chosen_prompt, chosen = split_response(_column(row, chosen_column, "data.chosen_column", where, columns),
                                           chosen_column)
    _, rejected = split_response(_column(row, rejected_column, "data.rejected_column", where, columns),
                                 rejected_column)
    prompt = as_messages(row[prompt_column], prompt_column) if prompt_column in row else []
    prompt = prompt + chosen_prompt  # the explicit prompt, then the conversation's own turns
    if not prompt:
        _column(row, prompt_column, "data.prompt_column", where, columns)  # raises
    margin = None
    if data_cfg.margin_column:
        value = _column(row, data_cfg.margin_column, "data.margin_column", where, columns)
        margin = margin_of(value, data_cfg.margin_column)
    return Example(prompt=prompt, chosen=chosen, rejected=rejected, margin=margin)


def to_demonstration(row: dict[str, Any], data_cfg: Any, where: str, columns: list[str]) -> Example:
    messages_column, response_column = data_cfg.messages_column, data_cfg.response_column
    if response_column not in row and messages_column in row:
        messages = row[messages_column]
        if isinstance(messages, str):
            raise RowError(f"column {messages_column!r} is text ({describe(messages)}), not a list of chat messages; "
                           "name text columns with data.prompt_column and data.response_column")
        prompt, response = split_response(messages, messages_column)
        return Example(prompt=prompt, chosen=response)
    implicit, response = split_response(_column(row, response_column, "data.response_column", where, columns),
                                        response_column)
    prompt = as_messages(_column(row, data_cfg.prompt_column, "data.prompt_column", where, columns),
                         data_cfg.prompt_column)
    return Example(prompt=prompt + implicit, chosen=response)


def to_examples(rows: list[dict[str, Any]], data_cfg: Any, where: str, pairs: bool) -> list[Example]:
    """Examples of ``rows``; invalid ones reported (index and reason) and dropped, or a DataError."""
    columns = sorted({key for row in rows for key in row}) if rows else []
    convert, problem = (to_pair, pair_problem) if pairs else (to_demonstration, demonstration_problem)
    examples, invalid = [], []
    for index, row in enumerate(rows):
        try:
            example = convert(row, data_cfg, where, columns)
        except RowError as error:  # a malformed file, whatever data.on_invalid says
            raise DataError(f"row {index} of {where}: {error}") from None
        reason = problem(example)
        if reason is None:
            examples.append(example)
            continue
        if data_cfg.on_invalid == "error":
            raise DataError(f"row {index} of {where}: {reason} (data.on_invalid=drop drops such rows)")
        invalid.append((index, reason))
    for index, reason in invalid[:REPORTED]:
        print(f"data: dropped row {index} of {where}: {reason}", file=sys.stderr)
    if len(invalid) > REPORTED:
        print(f"data: dropped {len(invalid) - REPORTED} more invalid rows of {where}", file=sys.stderr)
    return examples


def split_off_eval(examples: list[Example], fraction: float, seed: int) -> ExampleSplits:
    """A seeded share of the examples held out; prompts never straddle the split (grouped by prompt)."""
    if fraction <= 0 or len(examples) < 2:
        return ExampleSplits(train=examples, eval=[])
    prompts = list(dict.fromkeys(json.dumps(e.prompt) for e in examples))
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(len(prompts) - 1, max(1, round(fraction * len(prompts)))) if len(prompts) > 1 else 0
    held_out = {prompts[i] for i in order[:n_eval]}
    if not held_out:  # one prompt only: split rows instead
        cut = max(1, round(fraction * len(examples)))
        return ExampleSplits(train=examples[cut:], eval=examples[:cut])
    return ExampleSplits(train=[e for e in examples if json.dumps(e.prompt) not in held_out],
                         eval=[e for e in examples if json.dumps(e.prompt) in held_out])


def load_examples(data_cfg: Any, seed: int = 0, pairs: bool = True) -> ExampleSplits:
    """Train and eval examples of ``data_cfg``: preference pairs (``pairs``) or demonstrations."""
    if data_cfg.format not in FORMATS:
        raise DataError(f"data.format={data_cfg.format!r} is not valid; choose from: {', '.join(FORMATS)}")
    train_rows, eval_rows, train_where, eval_where = load_raw_splits(data_cfg)
    train = to_examples(train_rows, data_cfg, train_where, pairs)
    if eval_rows is not None:
        splits = ExampleSplits(train=train, eval=to_examples(eval_rows, data_cfg, eval_where, pairs))
    else:
        splits = split_off_eval(train, data_cfg.eval_fraction, seed)
    if not splits.train:
        raise DataError(f"{train_where} has no valid {'pairs' if pairs else 'demonstrations'} to train on")
    return splits
