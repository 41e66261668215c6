"""pass@k by the unbiased estimator and a group's distinct-n (rlhf_lab/training/diversity.py), against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhf_lab.training.diversity import group_distinct_n, group_metrics, pass_at_k


def brute_force(correct: list[bool], k: int) -> float:
    """The share of the k-subsets of one prompt's samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(k: int) -> None:
    rows = [[True, False, False, False, False, True], [False] * 6, [True] * 6, [False, False, True, False, False, False]]
    expected = sum(brute_force(row, k) for row in rows) / len(rows)
    assert pass_at_k(torch.tensor(rows), k) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="pass@7 needs at least 7 samples per prompt, got 6"):
        pass_at_k(torch.tensor(rows), 7)


def test_group_metrics_by_hand() -> None:
    texts = ["a b", "a b", "a c", "d e",  # group 1: bigrams ab, ab, ac, de -> 3 unique of 4
             "x y", "x y", "x y", "x y"]  # group 2: 1 of 4
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    metrics = group_metrics(scores, texts, 4, threshold=1.0)
    assert metrics["eval/group_distinct_2"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert metrics["eval/group_distinct_1"] == pytest.approx((5 / 8 + 2 / 8) / 2)  # words: a,b,a,b,a,c,d,e: 5 unique
    assert metrics["eval/pass@1"] == pytest.approx((1 / 4 + 0) / 2) and metrics["eval/pass@4"] == pytest.approx(0.5)
    assert "eval/pass@16" not in metrics  # 16 > G = 4
    assert set(group_metrics(scores, texts, 4, threshold=None)) == {"eval/group_distinct_1", "eval/group_distinct_2"}
    assert group_metrics(scores, texts, 1, threshold=1.0) == {}
    assert group_distinct_n(texts[:4], 4, 2) == pytest.approx(3 / 4)
