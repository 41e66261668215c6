"""Prompt files, line by line: a prompt must be a string, and a line must decode as UTF-8 (one DataError
naming the file and the line); ``datasets`` would otherwise turn 42, null or a list into prompt text."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_lab.data.prompts import check_rows
from rlhf_lab.errors import DataError, UserError


@pytest.mark.parametrize(("content", "message"), [
    (b'{"prompt": "ok"}\n{"prompt": 42}\n', "line 2: 'prompt' is a number (42), not a string or a list of messages"),
    (b'{"prompt": 1.5}\n', "line 1: 'prompt' is a number (1.5), not a string or a list of messages"),
    (b'{"prompt": null}\n', "line 1: 'prompt' is null (null), not a string or a list of messages"),
    (b'{"prompt": ["x", "y"]}\n', "line 1: 'prompt' is a list but message 0 is not {'role': ..., 'content': '...'}"),
    (b'{"prompt": [{"role": "boss", "content": "x"}]}\n', "line 1: 'prompt' is a list but message 0 has role 'boss'; roles: system, user, assistant, tool"),
    (b'{"prompt": []}\n', "line 1: 'prompt' is a list but not a non-empty list of messages"),
    (b'{"prompt": {"text": "x"}}\n', "line 1: 'prompt' is an object ({\"text\": \"x\"}), not a string or a list of messages"),
    (b'{"prompt": true}\n', "line 1: 'prompt' is a boolean (true), not a string or a list of messages"),
    (b'\n["a list line"]\n', "line 2: expected a JSON object, got a list"),
    (b'{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON (Expecting value)"),
    (b'{"prompt": "ok"}\n{"prompt": "\xff"}\n', "line 2: not valid UTF-8 (byte 0xff at column 13); save the file as "
     "UTF-8"),
], ids=["number", "float", "null", "list", "bad_role", "empty_list", "object", "boolean", "not_an_object", "torn_json",
        "not_utf8"])
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
    with pytest.raises(DataError, match=rf"^prompt 0 of {numbers} is a number \(42\), not a string or a list of messages$"):
        load("csv", numbers)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "a film"}\n{"text": "no prompt here"}\n')
    with pytest.raises(DataError, match=rf"^prompt 1 of {missing} is null \(None\), not a string or a list of messages$"):
        load("jsonl", missing)


def test_conversational_prompts_and_columns_travel_with_the_prompt(tmp_path: Path, tiny_tokenizer) -> None:
    """TRL's conversational format with a system message and a ground-truth column: the prompt's text is the
    conversation, its messages go through the chat template as they are, and its row reaches the rewards."""
    import json
    import pickle

    from omegaconf import OmegaConf

    from rlhf_lab.data.prompts import format_prompts, load_prompts
    from rlhf_lab.data.rows import columns_of

    rows = [{"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
             "answer": "4", "level": 1},
            {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "level": 2}]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = load_prompts(OmegaConf.create({"name": "jsonl", "path": str(path), "prompt_column": "prompt",
                                             "train_split": "train", "eval_split": "eval", "eval_fraction": 0.0})).train
    assert prompts == ["system: Be terse.\nuser: 2+2?", "user: 3+3?"]
    assert prompts[0].messages == tuple(rows[0]["prompt"]) and prompts[1].columns == {"answer": "6", "level": 2}
    assert columns_of(prompts) == {"answer": ["4", "6"], "level": [1, 2]} and columns_of(["plain"]) == {}
    copied = pickle.loads(pickle.dumps(prompts[0]))
    assert copied.messages == prompts[0].messages and copied.columns == prompts[0].columns
    formatted = format_prompts(prompts, tiny_tokenizer, True, "Default system.")
    assert formatted[0] == tiny_tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True,
                                                              tokenize=False)  # its own system message kept
    assert formatted[1] == tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Default system."}, *rows[1]["prompt"]], add_generation_prompt=True,
        tokenize=False)
