"""Diversity of sampled responses, per prompt group (evaluation with ``eval.samples_per_prompt`` = G > 1):

- pass@k (Chen et al. 2021, the unbiased estimator): from G samples of a prompt of which c are correct,
  pass@k = 1 − C(G − c, k) / C(G, k), the chance that k samples drawn without replacement include a correct
  one, averaged over prompts; for each k ≤ G. A sample is correct when its score reaches ``eval.pass_threshold``.
- distinct-n of a group: unique word n-grams / all word n-grams among one prompt's G responses, averaged over
  prompts (``eval/distinct_2`` pools every response of the evaluation instead).
"""

from __future__ import annotations

from math import comb

from torch import Tensor

from rlhf_lab.training.records import distinct_n

PASS_AT = (1, 4, 16)


def pass_at_k(correct: Tensor, k: int) -> float:
    """Mean over prompts of 1 − C(G − c, k)/C(G, k); ``correct`` [P, G] bool, k ≤ G."""
    samples = correct.shape[-1]
    if not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {samples}")
    counts = correct.sum(-1).tolist()
    return sum(1.0 - comb(samples - c, k) / comb(samples, k) for c in counts) / max(len(counts), 1)


def group_distinct_n(texts: list[str], group_size: int, n: int) -> float:
    """Mean over prompt groups (``group_size`` consecutive texts) of the group's distinct-n."""
    groups = [texts[start : start + group_size] for start in range(0, len(texts), group_size)]
    return sum(distinct_n(group, n) for group in groups) / max(len(groups), 1)


def group_metrics(scores: Tensor, texts: list[str], group_size: int, threshold: float | None,
                  prefix: str = "eval/") -> dict[str, float]:
    """``pass@k`` (with a threshold) and ``group_distinct_1|2`` of samples in prompt order; {} for G = 1."""
    if group_size < 2:
        return {}
    metrics = {f"{prefix}group_distinct_{n}": group_distinct_n(texts, group_size, n) for n in (1, 2)}
    if threshold is not None:
        correct = (scores >= threshold).reshape(-1, group_size)
        metrics.update({f"{prefix}pass@{k}": pass_at_k(correct, k) for k in PASS_AT if k <= group_size})
    return metrics
