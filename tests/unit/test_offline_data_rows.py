"""Offline data files that are malformed: one DataError naming the file and the line or row (whatever
``data.on_invalid`` says); and the common variants that are valid data (a JSON array, a byte-order mark, a long
CSV field) load."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_offline_data import demo_cfg, pref_cfg

from rlhf_lab.errors import DataError, UserError
from rlhf_lab.offline.data import load_examples

MESSAGE = "is a list but message 0 is not {'role': ..., 'content': '...'}"
ROLES = "roles: system, user, assistant, tool"


@dataclass
class Bad:
    id: str
    name: str  # the file's name; .csv files are read as csv
    content: bytes
    message: str  # the error, after "{path}" or "row N of {path}: " where the message says so
    pairs: bool = True


def line(row: object) -> bytes:
    return json.dumps(row).encode() + b"\n"


PAIR = {"prompt": "p", "chosen": "good", "rejected": "bad"}
BAD = [
    Bad("jsonl_not_utf8", "p.jsonl", line(PAIR) + b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n',
        "data file '{path}', line 2: not valid UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"),
    Bad("csv_not_utf8_sft", "d.csv", b"prompt,response\nhi,caf\xe9\n",
        "data file '{path}', line 2: not valid UTF-8 (byte 0xe9 at column 7); save the file as UTF-8", pairs=False),
    Bad("chosen_a_number", "p.jsonl", line(PAIR) + line({**PAIR, "chosen": 42}),
        "row 1 of {path}: column 'chosen' is 42 (a number), not text or chat messages"),
    Bad("rejected_a_list_of_strings", "p.jsonl", line({**PAIR, "rejected": ["a", "b"]}),
        f"row 0 of {{path}}: column 'rejected' {MESSAGE}"),
    Bad("prompt_a_list_of_strings", "p.jsonl", line({**PAIR, "prompt": ["a", "b"]}),
        f"row 0 of {{path}}: column 'prompt' {MESSAGE}"),
    Bad("message_without_role", "p.jsonl", line({**PAIR, "chosen": [{"content": "x"}]}),
        f"row 0 of {{path}}: column 'chosen' is a list but message 0 has role None; {ROLES}"),
    Bad("message_without_content", "p.jsonl", line({**PAIR, "prompt": [{"role": "user"}]}),
        f"row 0 of {{path}}: column 'prompt' {MESSAGE}"),
    Bad("prompt_an_object", "p.jsonl", line({**PAIR, "prompt": {"text": "hi"}}),
        "row 0 of {path}: column 'prompt' is an object, not text or chat messages"),
    Bad("response_an_object_sft", "d.jsonl", line({"prompt": "p", "response": {"text": "hi"}}),
        "row 0 of {path}: column 'response' is an object, not text or chat messages", pairs=False),
    Bad("response_a_boolean_sft", "d.jsonl", line({"prompt": "p", "response": True}),
        "row 0 of {path}: column 'response' is true (a boolean), not text or chat messages", pairs=False),
    Bad("messages_a_list_of_strings_sft", "d.jsonl", line({"messages": ["hi", "hello"]}),
        f"row 0 of {{path}}: column 'messages' {MESSAGE}", pairs=False),
    Bad("messages_plain_text_sft", "d.jsonl", line({"messages": "hi there"}),
        "row 0 of {path}: column 'messages' is text ('hi there'), not a list of chat messages; name text columns "
        "with data.prompt_column and data.response_column", pairs=False),
    Bad("line_a_number", "p.jsonl", line(PAIR) + b"42\n",
        "{path}:2 is 42 (a number), not a JSON object of a row's columns (one per line)"),
    Bad("lines_of_lists", "p.jsonl", b'\n["p", "good", "bad"]\n["q", "fine", "poor"]\n',
        "{path}:2 is [\"p\", \"good\", \"bad\"] (a list), not a JSON object of a row's columns (one per line)"),
    Bad("json_array_of_lists", "p.json", b'[["p", "good", "bad"]]',
        "{path}: item 0 of its JSON array is [\"p\", \"good\", \"bad\"] (a list), not an object of a row's columns"),
    Bad("json_text", "p.json", b'"just text"\n',
        "{path}:1 is 'just text', not a JSON object of a row's columns (one per line)"),
    Bad("json_array_of_numbers", "p.json", b"[" + json.dumps(PAIR).encode() + b", 7]\n",
        "{path}: item 1 of its JSON array is 7 (a number), not an object of a row's columns"),
    Bad("json_array_torn", "p.json", b"[\n" + json.dumps(PAIR).encode() + b",\n",
        "{path}:3 is not JSON: Expecting value"),
    Bad("margin_text", "p.jsonl", line({**PAIR, "margin": "abc"}),
        "row 0 of {path}: column 'margin' (data.margin_column) is 'abc', not a finite number"),
    Bad("margin_nan", "p.jsonl", line(PAIR | {"margin": 1}) + b'{"prompt": "q", "chosen": "a", "rejected": "b", '
        b'"margin": NaN}\n', "row 1 of {path}: column 'margin' (data.margin_column) is NaN (a number), not a finite "
        "number"),
    Bad("margin_inf_csv", "p.csv", b"prompt,chosen,rejected,margin\np,good,bad,inf\n",
        "row 0 of {path}: column 'margin' (data.margin_column) is 'inf', not a finite number"),
    Bad("csv_row_with_an_extra_field", "p.csv", b"prompt,chosen,rejected\np,good,bad\nq,fine, really,bad\n",
        "{path}:3 has 4 fields, the header has 3 (prompt, chosen, rejected); quote a field that holds a comma"),
    Bad("csv_row_with_a_missing_field", "p.csv", b"prompt,chosen,rejected\np,good\n",
        "{path}:2 has 2 fields, the header has 3 (prompt, chosen, rejected); quote a field that holds a comma"),
]


@pytest.mark.parametrize("bad", BAD, ids=[bad.id for bad in BAD])
@pytest.mark.parametrize("on_invalid", ["drop", "error"])
def test_a_malformed_file_is_one_line_naming_file_and_row(bad: Bad, on_invalid: str, tmp_path: Path) -> None:
    path = tmp_path / bad.name
    path.write_bytes(bad.content)
    make_cfg = pref_cfg if bad.pairs else demo_cfg
    margin = {"margin_column": "margin"} if "margin" in bad.id else {}
    with pytest.raises(DataError) as raised:
        load_examples(make_cfg(path, on_invalid=on_invalid, **margin), pairs=bad.pairs)
    assert isinstance(raised.value, UserError)
    assert str(raised.value) == bad.message.replace("{path}", str(path))


def test_a_json_array_of_rows_loads_like_jsonl(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}", "margin": i / 2} for i in range(4)]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    loaded = [load_examples(pref_cfg(tmp_path / name, eval_fraction=0.0, margin_column="margin")).train
              for name in ("a.json", "l.jsonl")]
    assert loaded[0] == loaded[1]
    assert [(e.prompt_text, e.chosen, e.rejected, e.margin) for e in loaded[0]] == [
        (f"p{i}", f"good {i}", f"bad {i}", i / 2) for i in range(4)]


def test_a_byte_order_mark_is_dropped_in_csv_and_jsonl(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    (tmp_path / "p.csv").write_bytes(bom + b"prompt,chosen,rejected\r\nhi,caf\xc3\xa9,bad\r\n")
    (tmp_path / "p.jsonl").write_bytes(bom + line({"prompt": "hi", "chosen": "caf\u00e9", "rejected": "bad"}))
    for name in ("p.csv", "p.jsonl"):
        (example,) = load_examples(pref_cfg(tmp_path / name, eval_fraction=0.0)).train
        assert (example.prompt_text, example.chosen, example.rejected) == ("hi", "caf\u00e9", "bad")


def test_a_csv_field_past_the_default_limit_loads_and_the_limit_is_restored(tmp_path: Path) -> None:
    long_response = "word " * 40_000  # 200,000 characters; csv refuses fields past 131,072 by default
    path = tmp_path / "d.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerows([["prompt", "response"], ["write at length", long_response], ["say hi", "hi"]])
    limit = csv.field_size_limit()
    examples = load_examples(demo_cfg(path, eval_fraction=0.0), pairs=False).train
    assert [(e.prompt_text, e.chosen) for e in examples] == [("write at length", long_response), ("say hi", "hi")]
    assert csv.field_size_limit() == limit


def test_a_conversational_response_column_adds_its_turns_to_the_prompt(tmp_path: Path) -> None:
    """TRL's prompt-completion format: ``prompt`` and ``completion`` both lists of messages."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(line({"prompt": [{"role": "user", "content": "count"}],
                           "completion": [{"role": "assistant", "content": "1 2 3"}]}))
    (example,) = load_examples(demo_cfg(path, eval_fraction=0.0, response_column="completion"), pairs=False).train
    assert (example.prompt, example.chosen) == ([{"role": "user", "content": "count"}], "1 2 3")
