"""Prompt files, line by line: a prompt must be a string, and a line must decode as UTF-8 (one DataError
naming the file and the line); ``datasets`` would otherwise turn 42, null or a list into prompt text."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_lab.data.prompts import check_rows
from rlhf_lab.errors import DataError, UserError


@pytest.mark.parametrize(("content", "message"), [
    (b'{"prompt": "ok"}\n{"prompt": 42}\n', "line 2: 'prompt' is a number (42), not a string"),
    (b'{"prompt": 1.5}\n', "line 1: 'prompt' is a number (1.5), not a string"),
    (b'{"prompt": null}\n', "line 1: 'prompt' is null (null), not a string"),
    (b'{"prompt": ["x", "y"]}\n', "line 1: 'prompt' is a list ([\"x\", \"y\"]), not a string"),
    (b'{"prompt": {"text": "x"}}\n', "line 1: 'prompt' is an object ({\"text\": \"x\"}), not a string"),
    (b'{"prompt": true}\n', "line 1: 'prompt' is a boolean (true), not a string"),
    (b'\n["a list line"]\n', "line 2: expected a JSON object, got a list"),
    (b'{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON (Expecting value)"),
    (b'{"prompt": "ok"}\n{"prompt": "\xff"}\n', "line 2: not valid UTF-8 (byte 0xff at column 13)"),
], ids=["number", "float", "null", "list", "object", "boolean", "not_an_object", "torn_json", "not_utf8"])
def test_a_bad_jsonl_line_names_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as raised:
        check_rows(path, "json", "prompt")
    assert isinstance(raised.value, UserError)
    assert str(raised.value) == f"data file {str(path)!r}, {message}"


def test_good_files_pass_and_csv_is_checked_for_utf8_only(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_bytes(b'{"prompt": "a film", "other": 3}\n\n{"prompt": "caf\xc3\xa9"}\n')
    check_rows(good, "json", "prompt")
    csv = tmp_path / "prompts.csv"
    csv.write_bytes(b"prompt\n42\n")
    check_rows(csv, "csv", "prompt")  # pandas types the column; the loaded values are checked later
    csv.write_bytes(b"prompt\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"line 2: not valid UTF-8 \(byte 0xe9 at column 4\)"):
        check_rows(csv, "csv", "prompt")


def test_loaded_prompts_that_are_not_strings_are_refused(tmp_path: Path) -> None:
    """A csv column pandas reads as numbers, or a jsonl line without the column (``datasets`` fills null)."""
    from omegaconf import OmegaConf

    from rlhf_lab.data.prompts import load_prompts

    def load(name: str, path: Path) -> None:
        load_prompts(OmegaConf.create({"name": name, "path": str(path), "prompt_column": "prompt",
                                       "train_split": "train", "eval_split": "eval", "eval_fraction": 0.0}))

    numbers = tmp_path / "numbers.csv"
    numbers.write_text("prompt\n42\n7\n")
    with pytest.raises(DataError, match=rf"^prompt 0 of {numbers} is a number \(42\), not a string$"):
        load("csv", numbers)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "a film"}\n{"text": "no prompt here"}\n')
    with pytest.raises(DataError, match=rf"^prompt 1 of {missing} is null \(None\), not a string$"):
        load("jsonl", missing)
