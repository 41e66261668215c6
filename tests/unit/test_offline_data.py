"""Preference pairs and demonstrations: every format loads; invalid rows are reported; token rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf_lab.config.schema_offline import DemonstrationDataConfig, PreferenceDataConfig
from rlhf_lab.errors import DataError
from rlhf_lab.offline.batch import Collator
from rlhf_lab.offline.data import load_examples

PAIRS = [{"prompt": f"prompt {i}", "chosen": f"good {i}", "rejected": f"bad {i}", "score": 0.5 * i} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def pref_cfg(path: Path, **fields) -> OmegaConf:
    return OmegaConf.merge(OmegaConf.structured(PreferenceDataConfig),
                           {"name": "preferences", "path": str(path), **fields})


def demo_cfg(path: Path, **fields) -> OmegaConf:
    return OmegaConf.merge(OmegaConf.structured(DemonstrationDataConfig),
                           {"name": "demonstrations", "path": str(path), **fields})


def test_jsonl_pairs_split_by_prompt_with_margin(tmp_path):
    splits = load_examples(pref_cfg(write_jsonl(tmp_path / "p.jsonl", PAIRS), margin_column="score",
                                    eval_fraction=0.2), seed=0)
    assert len(splits.train) == 8 and len(splits.eval) == 2
    assert not {e.prompt_text for e in splits.train} & {e.prompt_text for e in splits.eval}
    example = next(e for e in splits.train + splits.eval if e.prompt_text == "prompt 3")
    assert (example.chosen, example.rejected, example.margin) == ("good 3", "bad 3", 1.5)
    assert example.prompt == [{"role": "user", "content": "prompt 3"}]
    assert splits.held_out_prompts() == [e.prompt_text for e in splits.eval]


def test_csv_file_and_folder_with_eval_split_and_custom_columns(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for name, rows in (("train", PAIRS[:6]), ("eval", PAIRS[6:])):
        with open(folder / f"{name}.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["question", "good", "bad"])
            writer.writeheader()
            writer.writerows({"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows)
    splits = load_examples(pref_cfg(folder, prompt_column="question", chosen_column="good", rejected_column="bad"))
    assert [e.chosen for e in splits.train] == [f"good {i}" for i in range(6)]
    assert [e.rejected for e in splits.eval] == [f"bad {i}" for i in range(6, 10)]


def test_conversational_pairs_explicit_and_implicit_prompt(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}],
         "chosen": [{"role": "assistant", "content": "hello!"}], "rejected": [{"role": "assistant", "content": "go"}]},
        {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}, {"role": "assistant", "content": "yes"}],
         "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "no"}]},
    ]
    first, second = load_examples(pref_cfg(write_jsonl(tmp_path / "c.jsonl", rows), eval_fraction=0.0)).train
    assert first.prompt_text == "hi" and (first.chosen, first.rejected) == ("hello!", "go")
    assert [m["content"] for m in second.prompt] == ["a", "b", "c"] and second.prompt_text is None
    assert (second.chosen, second.rejected) == ("yes", "no")


def test_hub_format_reads_a_dataset_folder(tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", PAIRS[:7])
    write_jsonl(folder / "test.jsonl", PAIRS[7:])
    splits = load_examples(pref_cfg(folder, format="hub", eval_split="test"))
    assert len(splits.train) == 7 and len(splits.eval) == 3


def test_invalid_pairs_reported_with_index_and_reason_then_dropped_or_rejected(tmp_path, capsys):
    rows = [*PAIRS[:3], {"prompt": "p", "chosen": "same", "rejected": "same"},
            {"prompt": "q", "chosen": "  ", "rejected": "x"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    splits = load_examples(pref_cfg(path, eval_fraction=0.0))
    assert len(splits.train) == 3
    err = capsys.readouterr().err
    assert "row 3" in err and "identical chosen and rejected" in err and "row 4" in err and "empty chosen" in err
    with pytest.raises(DataError, match=r"row 3 of .*bad.jsonl: identical chosen and rejected"):
        load_examples(pref_cfg(path, on_invalid="error"))


def test_missing_column_is_one_line_naming_column_and_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "other": "c"}])
    with pytest.raises(DataError) as error:
        load_examples(pref_cfg(path))
    message = str(error.value)
    assert "'rejected'" in message and "p.jsonl" in message and "\n" not in message


def test_demonstrations_from_columns_and_messages(tmp_path):
    rows = [{"prompt": "say hi", "response": "hi"},
            {"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2 3"}]},
            {"prompt": "empty", "response": ""}]
    splits = load_examples(demo_cfg(write_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.0), pairs=False)
    assert [(e.prompt_text, e.chosen) for e in splits.train] == [("say hi", "hi"), ("count", "1 2 3")]


@pytest.fixture(scope="module")
def tokenizer():
    from rlhf_lab.models.loading import load_tokenizer

    return load_tokenizer(OmegaConf.create({"name": "tiny", "name_or_path": None}))


def test_rows_mask_the_response_and_its_eos_only(tmp_path, tokenizer):
    model_cfg = OmegaConf.create({"chat_template": True, "system_prompt": None})
    collator = Collator(tokenizer, model_cfg, demo_cfg(tmp_path, max_response_tokens=64))
    from rlhf_lab.offline.data import Example

    examples = [Example(prompt=[{"role": "user", "content": "a much longer prompt here"}], chosen="short"),
                Example(prompt=[{"role": "user", "content": "hi"}], chosen="a somewhat longer response")]
    rows = collator.demonstrations(examples)
    for row, example in enumerate(examples):
        response = tokenizer(example.chosen, add_special_tokens=False)["input_ids"]
        length = int(rows.response_mask[row].sum())
        assert length == len(response) + 1
        assert rows.response_ids[row, :length].tolist() == [*response, tokenizer.eos_token_id]
        prompt = collator.prompt_ids(example)
        assert rows.input_ids[row, rows.prompt_width - len(prompt) : rows.prompt_width].tolist() == prompt
        assert int(rows.attention_mask[row].sum()) == len(prompt) + length
    pairs = collator.pairs([Example(prompt=[{"role": "user", "content": "x"}], chosen="yes", rejected="no no")])
    assert pairs.batch_size == 2 and pairs.group_size == 2
    assert pairs.input_ids[0, : pairs.prompt_width].tolist() == pairs.input_ids[1, : pairs.prompt_width].tolist()
    cut = Collator(tokenizer, model_cfg, demo_cfg(tmp_path, max_response_tokens=2)).demonstrations(examples[1:])
    assert int(cut.response_mask.sum()) == 2 and tokenizer.eos_token_id not in cut.response_ids[0].tolist()


def test_packed_demonstrations_longer_than_a_row_are_cut_as_unpacked_ones(tmp_path, tokenizer):
    from rlhf_lab.offline.data import Example

    model_cfg = OmegaConf.create({"chat_template": False, "system_prompt": None})
    collator = Collator(tokenizer, model_cfg, demo_cfg(tmp_path, max_prompt_tokens=64, max_response_tokens=64))
    prompt, response = "one two three four five six", "seven eight nine ten"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    example = Example(prompt=[{"role": "user", "content": prompt}], chosen=response)
    whole = collator.packed_demonstrations([example], None)  # a row of 64 + 64 tokens: nothing is cut
    assert whole.input_ids[0].tolist() == [*prompt_ids, *response_ids, tokenizer.eos_token_id]
    room = len(prompt_ids) + 2  # the prompt, then 2 response tokens (and no EOS: the response is cut)
    cut = collator.packed_demonstrations([example], room)
    assert cut.input_ids[0].tolist() == [*prompt_ids, *response_ids[:2]]
    assert cut.response_mask[0].tolist()[-2:] == [1.0, 1.0] and int(cut.response_mask.sum()) == 2
    short = collator.packed_demonstrations([example], 4)  # the prompt keeps its last 3 tokens, 1 response token
    assert short.input_ids[0].tolist() == [*prompt_ids[-3:], response_ids[0]]
