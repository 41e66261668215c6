"""KL penalty: per-token estimators, exact KL, coefficient controllers, where the penalty acts, and which
combinations are right.

- :mod:`~rlhf_lab.kl.estimators`: estimators (kind ``kl``): ``estimator(logprobs, ref_logprobs, logits=None,
  ref_logits=None) -> [B, T]``, e.g. ``get("kl", "k3")(logprobs, ref_logprobs)``; the straight-through and
  sequence-level variants; :func:`estimate` (options: clamps, mask) and :func:`importance_weights`.
- :mod:`~rlhf_lab.kl.exact`: :func:`exact_kl`, the exact per-position KL from full logits (``kl/exact``).
- :mod:`~rlhf_lab.kl.controllers`: coefficient controllers (kind ``kl_controller``): ``fixed``, ``adaptive``.
- :mod:`~rlhf_lab.kl.placements`: placements (kind ``kl_placement``): ``reward``, ``loss``; :class:`KLPenalty`,
  the run's penalty at both points of a step.
- :mod:`~rlhf_lab.kl.corrections`: the off-policy weights of a loss-placed KL (kind ``kl_correction``).
- :mod:`~rlhf_lab.kl.truth`: the tables of which estimator × placement is unbiased for ∇KL(π‖π_ref), for one
  token and for sequences, the pairs with zero expected gradient, and the advantage estimators' effect (on a
  reward-placed KL, and on a loss-placed one beside the task reward with ``kl.loss_scale``), and the
  sampler–trainer correction's reach, which corrections are exact off-policy, and the
  loss aggregations' invariance to micro-batching.

Sources: J. Schulman, "Approximating KL Divergence" (2020); "A Comedy of Estimators" (arXiv 2512.21852);
"On a few pitfalls in KL divergence gradient estimation for RL" (arXiv 2506.09477); verl's ``kl_penalty``.
"""

from rlhf_lab.kl.controllers import AdaptiveKLController, FixedKLController
from rlhf_lab.kl.estimators import (
    absolute,
    estimate,
    full,
    importance_weights,
    k1,
    k1_plus,
    k2,
    k3,
    k3_plus,
    log_ratio,
    no_kl,
    sequence_full,
    sequence_k1,
    straight_through,
)
from rlhf_lab.kl.exact import exact_kl
from rlhf_lab.kl.placements import KLPenalty, LossPlacement, RewardPlacement
from rlhf_lab.kl.truth import (
    CORRECTION_SETTINGS,
    KL_LOSS_SCALE_UNDER_ADVANTAGE,
    MICRO_BATCH_INVARIANCE,
    MULTI_TURN_MASK,
    OFF_POLICY_CORRECTIONS,
    OFF_POLICY_KL_GRADIENT,
    OFF_POLICY_SEQUENCE_KL_GRADIENT,
    POLICY_CORRECTION_GRADIENT,
    POLICY_CORRECTIONS,
    REVERSE_KL_GRADIENT_UNBIASED,
    REWARD_KL_UNDER_ADVANTAGE,
    SAMPLER_CORRECTION,
    SEQUENCE_KL_GRADIENT_UNBIASED,
    ZERO_KL_GRADIENT,
    zero_gradient_warning,
)

__all__ = [
    "CORRECTION_SETTINGS", "KL_LOSS_SCALE_UNDER_ADVANTAGE", "MICRO_BATCH_INVARIANCE", "MULTI_TURN_MASK",
    "OFF_POLICY_CORRECTIONS", "OFF_POLICY_KL_GRADIENT", "OFF_POLICY_SEQUENCE_KL_GRADIENT", "POLICY_CORRECTION_GRADIENT",
    "POLICY_CORRECTIONS", "REVERSE_KL_GRADIENT_UNBIASED", "REWARD_KL_UNDER_ADVANTAGE", "SAMPLER_CORRECTION",
    "SEQUENCE_KL_GRADIENT_UNBIASED", "ZERO_KL_GRADIENT",
    "AdaptiveKLController", "FixedKLController", "KLPenalty", "LossPlacement", "RewardPlacement", "absolute", "estimate",
    "exact_kl", "full", "importance_weights", "k1", "k1_plus", "k2", "k3", "k3_plus", "log_ratio", "no_kl",
    "sequence_full", "sequence_k1", "straight_through", "zero_gradient_warning",
]
