"""Prompt sources (rlhf_lab/data/prompts.py): the embedded set, local jsonl/csv files and folders, and the order in
which prompts are drawn."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rlhf_lab.data.prompts import DataError, load_prompts, prompt_indices


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


# ------------------------------------------------------------------------------------- embedded set


def test_embedded_prompts_are_large_enough_and_disjoint(compose) -> None:
    cfg = compose([])
    assert cfg.data.name == "movie_prompts"
    splits = load_prompts(cfg.data, seed=0)
    assert len(splits.train) >= 300
    assert len(splits.eval) >= 60
    assert set(splits.train).isdisjoint(splits.eval)
    assert all(isinstance(p, str) and p.strip() for p in splits.train + splits.eval)
    assert load_prompts(cfg.data, seed=5).train == splits.train  # files with both splits: the seed plays no part


# ------------------------------------------------------------------------------------ prompt order


def test_prompt_indices_are_a_pure_function_of_their_arguments() -> None:
    first = [prompt_indices(step, 3, 10, seed=0) for step in range(8)]
    again = [prompt_indices(step, 3, 10, seed=0) for step in range(8)]
    assert first == again
    assert all(len(indices) == 3 for indices in first)
    # A resumed run asks for step 5 alone and gets what the uninterrupted run drew at step 5.
    assert prompt_indices(5, 3, 10, seed=0) == first[5]


def test_every_prompt_comes_once_per_epoch() -> None:
    # 3 prompts per step over 10 prompts: positions 0..29 of steps 0..9 are exactly three epochs.
    drawn = [i for step in range(10) for i in prompt_indices(step, 3, 10, seed=0)]
    epochs = [drawn[0:10], drawn[10:20], drawn[20:30]]
    for epoch in epochs:
        assert sorted(epoch) == list(range(10))
    assert epochs[0] != epochs[1]  # each epoch is shuffled afresh


def test_prompt_order_depends_on_the_seed() -> None:
    seed_0 = [i for step in range(5) for i in prompt_indices(step, 2, 10, seed=0)]
    seed_1 = [i for step in range(5) for i in prompt_indices(step, 2, 10, seed=1)]
    assert sorted(seed_0) == sorted(seed_1) == list(range(10))
    assert seed_0 != seed_1


def test_ranks_split_a_step_between_them() -> None:
    whole = prompt_indices(4, 4, 50, seed=3)
    rank_0 = prompt_indices(4, 4, 50, seed=3, rank=0, world_size=2)
    rank_1 = prompt_indices(4, 4, 50, seed=3, rank=1, world_size=2)
    # Contiguous blocks of whole prompts: rank 0's then rank 1's is the one-process list.
    assert rank_0 == whole[:2] and rank_1 == whole[2:]
    assert rank_0 + rank_1 == whole


# --------------------------------------------------------------------------------------- local files


def test_jsonl_file_with_a_custom_column(compose, tmp_path: Path) -> None:
    rows = [{"text": f"Prompt {i}", "score": i} for i in range(5)]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = compose(["data=jsonl", f"data.path={path}", "data.prompt_column=text"])
    splits = load_prompts(cfg.data, seed=0)
    assert splits.train == [f"Prompt {i}" for i in range(5)]
    assert splits.eval == []


def test_csv_file_with_quoted_commas_and_an_eval_fraction(compose, tmp_path: Path) -> None:
    questions = [f"Is film {i}, the sequel, any good?" for i in range(8)]
    path = write_csv(tmp_path / "questions.csv", ["id", "question"], [[i, q] for i, q in enumerate(questions)])
    cfg = compose(["data=csv", f"data.path={path}", "data.prompt_column=question", "data.eval_fraction=0.25"])
    splits = load_prompts(cfg.data, seed=0)
    assert len(splits.eval) == 2 and len(splits.train) == 6  # round(0.25 · 8) = 2
    assert sorted(splits.train + splits.eval) == sorted(questions)
    assert load_prompts(cfg.data, seed=0) == splits  # the carve-out is seeded
    assert any(load_prompts(cfg.data, seed=seed).eval != splits.eval for seed in (1, 2, 3))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_folder_with_train_and_eval_files(compose, tmp_path: Path, fmt: str) -> None:
    train = [f"Train prompt {i}" for i in range(4)]
    evaluation = [f"Eval prompt {i}" for i in range(2)]
    for name, prompts in (("train", train), ("eval", evaluation)):
        if fmt == "jsonl":
            write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": p} for p in prompts])
        else:
            write_csv(tmp_path / f"{name}.csv", ["prompt"], [[p] for p in prompts])
    splits = load_prompts(compose([f"data={fmt}", f"data.path={tmp_path}"]).data, seed=0)
    assert splits.train == train
    assert splits.eval == evaluation


def test_folder_without_eval_file_asks_for_an_eval_fraction(compose, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "only train"}])
    with pytest.raises(DataError) as error:
        load_prompts(compose(["data=jsonl", f"data.path={tmp_path}"]).data, seed=0)
    assert str(error.value) == f"data.path={str(tmp_path)!r} has no eval.jsonl; set data.eval_fraction"


def test_missing_column_names_the_columns(compose, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "a", "id": 1}, {"text": "b", "id": 2}])
    with pytest.raises(DataError) as error:
        load_prompts(compose(["data=jsonl", f"data.path={path}"]).data, seed=0)
    assert str(error.value) == f"data.prompt_column='prompt' is not a column of {path}; columns: ['text', 'id']"


@pytest.mark.parametrize("blank", ["", "   "])
def test_empty_prompt_names_its_index(compose, tmp_path: Path, blank: str) -> None:
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "fine"}, {"prompt": "also fine"}, {"prompt": blank}])
    with pytest.raises(DataError) as error:
        load_prompts(compose(["data=jsonl", f"data.path={path}"]).data, seed=0)
    assert str(error.value) == f"prompt 2 of {path} is empty"
