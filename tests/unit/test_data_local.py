"""``data=local``: a file or folder in any format ``datasets`` reads (jsonl, json, csv, parquet, save_to_disk), told
by its extension or layout, offline; a ``messages`` column found without a flag."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict
from omegaconf import DictConfig, OmegaConf

from rlhf_lab.config import compose
from rlhf_lab.data.prompts import load_prompts
from rlhf_lab.errors import DataError

ROWS = [{"prompt": f"question {i}", "data_source": "math" if i % 2 else "code", "answer": str(i)} for i in range(6)]
TEXTS = [row["prompt"] for row in ROWS]


@functools.cache
def data_config(option: str) -> DictConfig:
    """``data=OPTION`` as composed (once: composing takes a second)."""
    return compose(["model=tiny", f"data={option}", "data.path=."]).data


def prompts(path: Path, *extra: str, option: str = "local"):
    cfg = OmegaConf.merge(data_config(option), OmegaConf.from_dotlist([f"path={path}", *(e.removeprefix("data.")
                                                                                        for e in extra)]))
    return load_prompts(cfg, seed=0)


def write_each_format(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.from_list(ROWS)
    paths = {"jsonl": folder / "rows.jsonl", "json": folder / "rows.json", "csv": folder / "rows.csv",
             "parquet": folder / "rows.parquet", "saved": folder / "saved"}
    paths["jsonl"].write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    paths["json"].write_text(json.dumps(ROWS))  # an array of objects, not JSON lines
    dataset.to_csv(str(paths["csv"]), index=False)
    dataset.to_parquet(str(paths["parquet"]))
    dataset.save_to_disk(str(paths["saved"]))
    return paths


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved"])
def test_every_format_gives_the_same_prompts_and_columns(tmp_path: Path, kind: str) -> None:
    path = write_each_format(tmp_path)[kind]
    splits = prompts(path)
    assert list(splits.train) == TEXTS and splits.eval == []
    assert [p.columns["data_source"] for p in splits.train] == ["code", "math"] * 3
    assert str(splits.train[3].columns["answer"]) == "3"
    held_out = prompts(path, "data.eval_fraction=0.5")
    assert sorted([*held_out.train, *held_out.eval]) == sorted(TEXTS) and len(held_out.eval) == 3


def test_a_dataset_dict_and_a_folder_of_split_files_give_their_splits(tmp_path: Path) -> None:
    both = DatasetDict({"train": Dataset.from_list(ROWS[:4]), "test": Dataset.from_list(ROWS[4:])})
    both.save_to_disk(str(tmp_path / "dict"))
    splits = prompts(tmp_path / "dict", "data.eval_split=test")
    assert (list(splits.train), list(splits.eval)) == (TEXTS[:4], TEXTS[4:])
    with pytest.raises(DataError, match=r"has no split 'learn' \(data.train_split\); splits: train, test"):
        prompts(tmp_path / "dict", "data.train_split=learn")

    folder = tmp_path / "files"
    folder.mkdir()
    Dataset.from_list(ROWS[:4]).to_parquet(str(folder / "train.parquet"))
    (folder / "eval.csv").write_text("prompt\nquestion 4\nquestion 5\n")
    splits = prompts(folder)
    assert (list(splits.train), list(splits.eval)) == (TEXTS[:4], TEXTS[4:])


def test_parquet_and_saved_folders_through_the_jsonl_option_too(tmp_path: Path) -> None:
    paths = write_each_format(tmp_path)
    assert list(prompts(paths["parquet"], option="jsonl").train) == TEXTS  # was "not valid UTF-8"
    assert list(prompts(paths["saved"], option="jsonl").train) == TEXTS


def test_a_messages_column_is_the_prompt_without_a_flag(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
             "data_source": "math"} for i in range(3)]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    splits = prompts(tmp_path / "chat.parquet")
    assert [p.messages[-1]["content"] for p in splits.train] == ["q0", "q1", "q2"]
    assert splits.train[0] == "system: Be brief.\nuser: q0" and splits.train[0].columns == {"data_source": "math"}


def test_unknown_extensions_and_layouts_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "rows.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"cannot tell its format from the extension '.txt'; data=local reads "
                                        r".jsonl, .json, .csv, .parquet files and save_to_disk folders"):
        prompts(tmp_path / "rows.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"needs one train.<ext> file .* or a save_to_disk dataset; found: none"):
        prompts(tmp_path / "empty")


def _torn_arrow(folder: Path) -> None:
    arrow = next(folder.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])


@pytest.mark.parametrize(("damage", "reason"), [
    (_torn_arrow, "cannot read {path} as a save_to_disk dataset: "),
    (lambda folder: (folder / "dataset_info.json").write_text('{"features": '), "cannot read {path} as a save_to_disk "
                                                                               "dataset: "),
    (lambda folder: (folder / "state.json").unlink(), "cannot read {path} as a save_to_disk dataset: "),
    (lambda folder: next(folder.glob("*.arrow")).unlink(), "cannot read {path} as a save_to_disk dataset: "),
], ids=["torn_arrow", "torn_info", "no_state", "no_arrow"])
def test_a_damaged_save_to_disk_folder_is_one_line_naming_it(tmp_path: Path, damage, reason: str) -> None:
    folder = tmp_path / "saved"
    Dataset.from_list(ROWS).save_to_disk(str(folder))
    damage(folder)
    with pytest.raises(DataError) as caught:
        prompts(folder)
    message = str(caught.value)
    assert message.startswith(reason.format(path=folder)) and "\n" not in message, message


def test_a_torn_dataset_dict_and_an_empty_dataset_are_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "dict"
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(folder))
    (folder / "dataset_dict.json").write_text('{"splits": ["tr')
    with pytest.raises(DataError, match=rf"^cannot read {folder} as a save_to_disk dataset: "):
        prompts(folder)
    empty = tmp_path / "empty_saved"
    Dataset.from_list(ROWS).select([]).save_to_disk(str(empty))  # datasets writes no data file for it
    with pytest.raises(DataError, match=rf"^cannot read {empty} as a save_to_disk dataset: "):
        prompts(empty)
    empty_split = tmp_path / "empty_split"
    DatasetDict({"train": Dataset.from_list(ROWS).filter(lambda row: False)}).save_to_disk(str(empty_split))
    with pytest.raises(DataError, match=rf"^{empty_split} holds no rows: no prompt to train on$"):
        prompts(empty_split)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError) as caught:
        prompts(tmp_path / "empty.jsonl")
    assert "\n" not in str(caught.value) and "empty.jsonl" in str(caught.value)
