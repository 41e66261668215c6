"""Mode collapse measured exactly on the exact task: the entropy of π against π*'s, and, when several responses
share the highest reward (``reward.modes``), how π splits its mass over those optimal modes against π*'s split.

With M ≥ 2 equally rewarded optimal responses m_1..m_M (ordered by the reference's mass, m_1 its favourite),
π* ∝ π_ref·exp(R/β) splits its mass on them exactly as π_ref does, at every β. With p_k = π(m_k)/Σ_j π(m_j) and
p*_k the same for π*:

    exact/entropy, exact/entropy_optimal        H(π), H(π*) over all responses (nats)
    exact/mode_mass, exact/mode_mass_optimal    Σ_k π(m_k), Σ_k π*(m_k)
    exact/mode_mass/<k>, exact/mode_mass_optimal/<k>   π(m_k), π*(m_k)
    exact/mode_coverage                         Σ_k min(p_k, p*_k): 1 when π splits as π* does, 1/M·… when it
                                                collapses onto one mode π* shares with others
    exact/modes_effective, exact/modes_effective_optimal   exp(entropy of p), of p*: how many modes are kept
"""

from __future__ import annotations

import torch
from torch import Tensor

TIE = 1e-9  # rewards this close to the best count as optimal modes


def _entropy(log_probs: Tensor) -> float:
    probs = log_probs.exp()
    return float(-(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum())


def mode_metrics(log_policy: Tensor, log_optimal: Tensor, log_ref: Tensor, rewards: Tensor) -> dict[str, float]:
    """The metrics above from every response's sequence log-probs under π, π* and π_ref and its reward ([N] each,
    float64)."""
    metrics = {"exact/entropy": _entropy(log_policy), "exact/entropy_optimal": _entropy(log_optimal)}
    modes = (rewards >= rewards.max() - TIE).nonzero().squeeze(-1)
    if len(modes) < 2:
        return metrics
    modes = modes[log_ref[modes].argsort(descending=True)]  # mode 0: the reference's favourite
    mass, mass_optimal = log_policy[modes].exp(), log_optimal[modes].exp()
    split, split_optimal = mass / mass.sum(), mass_optimal / mass_optimal.sum()
    metrics.update({
        "exact/mode_mass": float(mass.sum()),
        "exact/mode_mass_optimal": float(mass_optimal.sum()),
        "exact/mode_coverage": float(torch.minimum(split, split_optimal).sum()),
        "exact/modes_effective": float(torch.exp(torch.as_tensor(_entropy(split.log())))),
        "exact/modes_effective_optimal": float(torch.exp(torch.as_tensor(_entropy(split_optimal.log())))),
    })
    for k in range(len(modes)):
        metrics[f"exact/mode_mass/{k}"] = float(mass[k])
        metrics[f"exact/mode_mass_optimal/{k}"] = float(mass_optimal[k])
    return metrics
