"""Prompt sets: the embedded ``movie_prompts``, local jsonl/csv files or folders, and hub datasets.

Every source is loaded with ``datasets`` and reduced to two lists of prompts (train, eval): each a
:class:`~rlhf_lab.data.rows.Prompt`, the prompt's text with its row (a conversation's messages, the other columns,
which rewards read). The order prompts are drawn in is a pure function of (seed, step), so a resumed run sees the
same ones.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_lab.data.local import root_cause as _root_cause
from rlhf_lab.data.rows import Prompt, make_prompt, messages_problem
from rlhf_lab.errors import ConfigError, DataError

EMBEDDED = {"movie_prompts": Path(__file__).parents[1] / "assets" / "movie_prompts"}
FILE_FORMATS = {"jsonl": ("json", ".jsonl"), "csv": ("csv", ".csv")}
DEFAULT_COLUMN, MESSAGES_COLUMN = "prompt", "messages"
EVAL_CHUNK = 16  # held-out prompts generated at once (the offline stages: held-out examples per forward pass)


@dataclass
class PromptSplits:
    train: list[str]
    eval: list[str]

    def digest(self) -> str:
        """sha256 of both splits' prompts, in order: what a checkpoint records, so a resume on a data file edited
        since is named (:func:`rlhf_lab.training.resume_contract.check_prompts`)."""
        text = json.dumps([self.train, self.eval], sort_keys=True, default=str, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _column(dataset: Any, column: str, where: str) -> list[Prompt]:
    """The prompts of ``column`` (text, or conversations), each with the row's other columns. Without a ``prompt``
    column, a ``messages`` column (the conversational format) is the prompt, with no flag needed."""
    if column == DEFAULT_COLUMN and column not in dataset.column_names and MESSAGES_COLUMN in dataset.column_names:
        column = MESSAGES_COLUMN
    if column not in dataset.column_names:
        raise DataError(f"data.prompt_column={column!r} is not a column of {where}; columns: {dataset.column_names}")
    values = dataset[column]
    for index, value in enumerate(values):
        if isinstance(value, str):
            if not value.strip():
                raise DataError(f"prompt {index} of {where} is empty")
            continue
        problem = messages_problem(value) if isinstance(value, list) else None
        if problem is not None:
            raise DataError(f"prompt {index} of {where} is a list but {problem}")
        if not isinstance(value, list):
            kind = JSON_TYPES.get(type(value), type(value).__name__)
            raise DataError(f"prompt {index} of {where} is {kind} ({str(value)[:40]}), not a string or a list of "
                            "messages")
    others = [name for name in dataset.column_names if name != column]
    rows = dataset.select_columns(others).to_list() if others else [{} for _ in values]
    return [make_prompt(value, row, f"row {index} of {where}")
            for index, (value, row) in enumerate(zip(values, rows, strict=True))]


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
    for file in files.values():
        if _is_blank(file):
            raise DataError(f"data file {str(file)!r} is empty; it needs at least one prompt")
        check_rows(file, builder, data_cfg.prompt_column)
    try:
        loaded = load_dataset(builder, data_files={k: str(v) for k, v in files.items()})
    except Exception as error:  # noqa: BLE001 (datasets raises many types for an unreadable file)
        raise DataError(f"cannot read {', '.join(map(str, files.values()))} as {builder}: {_root_cause(error)}") from None
    train = _column(loaded["train"], data_cfg.prompt_column, str(files["train"]))
    if "eval" in files:
        return PromptSplits(train=train, eval=_column(loaded["eval"], data_cfg.prompt_column, str(files["eval"])))
    if data_cfg.eval_fraction <= 0:
        return PromptSplits(train=train, eval=[])
    return _split_off_eval(train, data_cfg.eval_fraction, seed)


JSON_TYPES = {int: "a number", float: "a number", bool: "a boolean", type(None): "null", list: "a list", dict: "an object"}


def text_lines(file: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of ``file`` as UTF-8, a leading byte-order mark dropped; a line that is
    not UTF-8 is a DataError naming the file, the line and the byte."""
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            skip = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                line = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as error:
                at = skip + error.start
                raise DataError(f"data file {str(file)!r}, line {number}: not valid UTF-8 (byte {raw[at]:#04x} at "
                                f"column {at + 1}); save the file as UTF-8") from None
            yield number, line


def check_rows(file: Path, builder: str, column: str) -> None:
    """Every line decodes as UTF-8 and, in a jsonl file, is an object whose ``column`` (when it has one) is a
    string: ``datasets`` would otherwise turn 42, null or a list into the prompts "42", "None", "['x']"."""
    for number, line in text_lines(file):
        if builder != "json" or not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise DataError(f"data file {str(file)!r}, line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"data file {str(file)!r}, line {number}: expected a JSON object, got "
                            f"{JSON_TYPES.get(type(row), type(row).__name__)}")
        if column in row and isinstance(row[column], list):
            problem = messages_problem(row[column])
            if problem is not None:
                raise DataError(f"data file {str(file)!r}, line {number}: {column!r} is a list but {problem}")
        elif column in row and not isinstance(row[column], str):
            value = row[column]
            raise DataError(f"data file {str(file)!r}, line {number}: {column!r} is "
                            f"{JSON_TYPES.get(type(value), type(value).__name__)} ({json.dumps(value)[:40]}), "
                            "not a string or a list of messages")


def _is_blank(file: Path) -> bool:
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def check_prompt_lengths(splits: PromptSplits, count_tokens: Callable[[list[str]], list[int]], limit: int,
                         why: str) -> None:
    """Raise DataError naming the first prompt (split and index) longer than ``limit`` tokens.

    ``count_tokens`` gives each prompt's length as the model sees it (chat template included); ``why``
    says where the limit comes from. Checked once at start, so no step fails on a long prompt later.
    """
    for split, prompts in (("train", splits.train), ("eval", splits.eval)):
        for start in range(0, len(prompts), 1024):
            counts = count_tokens(prompts[start : start + 1024])
            for offset, count in enumerate(counts):
                if count > limit:
                    index = start + offset
                    raise DataError(
                        f"{split} prompt {index} is {count} tokens, over the limit of {limit} ({why}): "
                        f"{prompts[index][:40]!r}..."
                    )


def prompt_token_limit(max_prompt_tokens: int, max_new_tokens: int, context: int | None) -> tuple[int, str]:
    """The longest prompt (tokens) a run can take, and why: ``data.max_prompt_tokens`` or what the model's
    context leaves after ``trainer.max_new_tokens``. No room at all is a config error."""
    if context is not None and context - max_new_tokens < 1:

        raise ConfigError(f"trainer.max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                          f"context of {context} tokens")
    if context is not None and context - max_new_tokens < max_prompt_tokens:
        return context - max_new_tokens, (
            f"the model's context of {context} tokens minus trainer.max_new_tokens={max_new_tokens}"
        )
    return max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"


def load_prompts(data_cfg: Any, seed: int = 0) -> PromptSplits:
    """Train and eval prompt lists for ``data_cfg`` (``name``: movie_prompts | jsonl | csv | hub | exact)."""
    if data_cfg.name == "exact":  # the exact task's one prompt: its BOS token (rlhf_lab/testbed/)
        from rlhf_lab.testbed.task import PROMPT

        return PromptSplits(train=[PROMPT], eval=[PROMPT])
    if data_cfg.name == "reasoning_gym":
        from rlhf_lab.data.reasoning_gym import reasoning_gym_prompts

        return PromptSplits(*reasoning_gym_prompts(data_cfg))
    if data_cfg.name in EMBEDDED:
        folder = EMBEDDED[data_cfg.name]
        splits = _load_files(_with_path(data_cfg, folder), "json", ".jsonl", seed)
    elif data_cfg.name == "local" or (data_cfg.name in FILE_FORMATS and another_format(data_cfg)):
        splits = _local_prompts(data_cfg, seed)
    elif data_cfg.name in FILE_FORMATS:
        builder, suffix = FILE_FORMATS[data_cfg.name]
        splits = _load_files(data_cfg, builder, suffix, seed)
    elif data_cfg.name == "hub":
        from datasets import load_dataset

        try:
            train_set = load_dataset(data_cfg.path, split=data_cfg.train_split)
            eval_set = load_dataset(data_cfg.path, split=data_cfg.eval_split)
        except Exception as error:  # noqa: BLE001 (offline, unknown dataset or split)
            raise DataError(f"data.path={data_cfg.path!r}: cannot load the hub dataset: {_root_cause(error)}") from None
        train = _column(train_set, data_cfg.prompt_column, f"{data_cfg.path}[{data_cfg.train_split}]")
        evaluation = _column(eval_set, data_cfg.prompt_column, f"{data_cfg.path}[{data_cfg.eval_split}]")
        splits = PromptSplits(train=train, eval=evaluation)
    else:
        valid = sorted([*EMBEDDED, *FILE_FORMATS, "local", "hub", "exact", "reasoning_gym"])
        raise DataError(f"data={data_cfg.name!r} is not a prompt source; valid: {', '.join(valid)}")
    if not splits.train:
        raise DataError(f"data={data_cfg.name!r} has no training prompts")
    return splits


def another_format(data_cfg: Any) -> bool:
    """``data=jsonl|csv`` given a parquet file or a ``save_to_disk`` folder: read as ``data=local`` reads it."""
    from rlhf_lab.data.local import BUILDERS, is_saved_dataset

    path = Path(str(data_cfg.path)) if data_cfg.get("path") else None
    if path is None:
        return False
    return is_saved_dataset(path) or (path.is_file() and BUILDERS.get(path.suffix.lower()) == "parquet")


def _local_prompts(data_cfg: Any, seed: int) -> PromptSplits:
    from rlhf_lab.data.local import load_local

    train_set, eval_set, where = load_local(data_cfg)
    train = _column(train_set, data_cfg.prompt_column, where)
    if eval_set is not None:
        return PromptSplits(train=train, eval=_column(eval_set, data_cfg.prompt_column, f"{where} ({data_cfg.eval_split})"))
    if data_cfg.eval_fraction <= 0:
        return PromptSplits(train=train, eval=[])
    return _split_off_eval(train, data_cfg.eval_fraction, seed)


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
    ranks each takes a contiguous block of the step's prompts (the one place prompts are sharded), so the
    ranks' blocks in rank order are the one-process list.
    """
    indices = []
    start = step * prompts_per_step
    for position in range(start, start + prompts_per_step):
        epoch, offset = divmod(position, n_prompts)
        order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        indices.append(int(order[offset]))
    per_rank = len(indices) // world_size
    return indices[rank * per_rank : (rank + 1) * per_rank]


def format_prompts(prompts: list[str], tokenizer: Any, chat_template: bool, system_prompt: str | None) -> list[str]:
    """Prompt strings as the model sees them: the chat template with a generation prompt, if it has one. A
    conversational prompt's messages go in as they are (``model.system_prompt`` first where they have no system
    message); without a chat template its text is used."""
    if not chat_template or not getattr(tokenizer, "chat_template", None):
        return list(prompts)
    formatted = []
    for prompt in prompts:
        messages = list(getattr(prompt, "messages", None) or [{"role": "user", "content": prompt}])
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        formatted.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return formatted


def check_model_prompts(splits: PromptSplits, tokenizer: Any, model: Any, cfg: Any) -> None:
    """Every prompt, as the model sees it (the chat template applied), must fit ``data.max_prompt_tokens`` and
    the model's context with ``trainer.max_new_tokens`` after it."""
    contexts = [getattr(model.config, "max_position_embeddings", None)]
    if tokenizer.model_max_length < 1_000_000:  # tokenizers without a limit report a huge number
        contexts.append(tokenizer.model_max_length)
    context = min((c for c in contexts if c), default=None)
    limit, why = prompt_token_limit(cfg.data.max_prompt_tokens, cfg.trainer.max_new_tokens, context)

    def count_tokens(prompts: list[str]) -> list[int]:
        formatted = format_prompts(prompts, tokenizer, cfg.model.chat_template, cfg.model.system_prompt)
        return [len(ids) for ids in tokenizer(formatted, add_special_tokens=False)["input_ids"]]

    check_prompt_lengths(splits, count_tokens, limit, why)
