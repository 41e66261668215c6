"""Which estimator × placement gives an unbiased gradient of the reverse KL(π‖π_ref), and how the advantage
estimators treat a reward-placed KL. Every cell is checked by exact enumeration in ``tests/unit/test_kl.py``
and ``tests/unit/test_kl_truth.py`` (tabular policies: expected gradient summed over every sequence).

On-policy x ~ π_θ, l(x) = log π(x) − log π_ref(x). The target is
    ∇KL(π‖π_ref) = ∇ Σ_x π l = E_π[l ∇log π] + E_π[∇log π] = E_π[l ∇log π]          (E_π[∇log π] = 0).
reward placement: reward −f(x), no gradient through f; REINFORCE's expected gradient of the penalty is
    E_π[f(x) ∇log π(x)].
loss placement: the sample carries no gradient, the estimate does (through log π(x) or the logits); the
    expected gradient is E_π[∇f(x)] — for a function of l, E_π[f'(l) ∇log π(x)].

Sequences x_1..x_T: KL(π‖π_ref) = E[Σ_t l_t], and its gradient is E[Σ_t ∇log π(x_t) · Σ_{t'≥t} l_t']; the
KL at position t also depends on the earlier tokens through the prefix. Critic-free algorithms sum the
per-token penalties into one return that weighs every token, so k1 in the reward carries that dependence;
a per-token estimator in the loss differentiates each position with its prefix held fixed and misses it.
"""

from __future__ import annotations

# (estimator, placement) -> is E[gradient] = ∇KL(π‖π_ref) for ONE token (= per position, prefix fixed)?
REVERSE_KL_GRADIENT_UNBIASED: dict[tuple[str, str], bool] = {
    ("kl", "reward"): True,  # E[l ∇log π]: exactly the target
    ("kl", "loss"): False,  # f' = 1: E[∇log π] = 0, no KL gradient at all in expectation
    ("abs", "reward"): False,  # E[|l| ∇log π] ≠ E[l ∇log π] whenever some sampled l < 0
    ("abs", "loss"): False,  # E[sign(l) ∇log π]: neither KL's gradient
    ("mse", "reward"): False,  # E[½ l² ∇log π]: the gradient of another functional
    ("mse", "loss"): True,  # f' = l: E[l ∇log π], the target (the GRPO-style choice that is right)
    ("k3", "reward"): False,  # E[(π_ref/π − 1 + l) ∇log π] = ∇KL(π‖π_ref) − ∇KL(π_ref‖π)
    ("k3", "loss"): False,  # f' = 1 − π_ref/π: E = −Σ π_ref ∇log π = ∇KL(π_ref‖π), the FORWARD KL's gradient
    ("full", "reward"): False,  # the same value whichever token was sampled: E[c ∇log π] = 0 at that position
    ("full", "loss"): True,  # the exact KL, differentiated exactly
    ("none", "reward"): False,  # no penalty: not applicable, recorded as False
    ("none", "loss"): False,
    ("k1_plus", "reward"): True,  # the value of k1: as k1 in the reward
    ("k1_plus", "loss"): True,  # the gradient of k2: E[l ∇log π]
    ("k3_plus", "reward"): False,  # the value of k3: as k3 in the reward
    ("k3_plus", "loss"): True,  # the gradient of k2
    ("sequence_k1", "reward"): True,  # the value of k1
    ("sequence_k1", "loss"): True,  # gradient l ∇log π for one token
    ("sequence_full", "reward"): False,  # the value of full: zero expected gradient at its own position
    ("sequence_full", "loss"): True,  # ∇KL exactly for one token
}

# (estimator, placement) -> is E[gradient] = ∇KL(π‖π_ref) of whole SEQUENCES (T > 1), with the penalties of a
# reward-placed estimator summed into the return every token is weighed by (REINFORCE, RLOO, GRPO)?
SEQUENCE_KL_GRADIENT_UNBIASED: dict[tuple[str, str], bool] = {
    **dict.fromkeys(REVERSE_KL_GRADIENT_UNBIASED, False),
    # E[Σ_t ∇log π(x_t) Σ_t' l_t']: the terms t' < t vanish in expectation, the rest are the target.
    ("kl", "reward"): True,
    ("k1_plus", "reward"): True,
    ("sequence_k1", "reward"): True,
    # The score function with the KL to go (sampled l_t', or the exact KL_t' of later positions, whose
    # conditional expectations are equal) plus the per-position term: the target.
    ("sequence_k1", "loss"): True,
    ("sequence_full", "loss"): True,
    # mse, full, k1_plus, k3_plus in the loss: per position with the prefix held fixed, so the part
    # E[Σ_t ∇log π(x_t) Σ_{t'>t} KL_t'] is missing. full in the reward has only that part.
}

# Pairs whose expected gradient is exactly zero for one token: the penalty does nothing on average. A run
# configured with one prints one warning at start (rlhf_lab/config/validate_kl.py) with this advice.
ZERO_KL_GRADIENT: dict[tuple[str, str], str] = {
    ("kl", "loss"): "E[∇log π] = 0; use kl.placement=reward, or kl=k1_plus / kl=sequence_k1 in the loss",
    ("full", "reward"): "its value does not depend on the sampled token (E[c·∇log π] = 0 at each position; "
                        "it reaches earlier tokens only through the return); use kl.placement=loss",
    ("sequence_full", "reward"): "in the reward it is `full`; use kl.placement=loss",
}

# How the advantage estimator (algorithm.advantage, with algorithm.baseline for reinforce) treats a
# reward-placed k1 penalty, measured by exact enumeration with groups of G = 2 (one token, every pair of
# samples): "exact" — E[A·∇log π] is the KL gradient; "scaled" — multiplied by (1 − 1/G) (by (1 − 1/B) over
# the whole batch for batch_mean): a baseline that includes the sample itself; the task reward is scaled by
# the same factor, so the optimum is unchanged, only the step is smaller, but a loss-placed KL next to it is
# not scaled (its effective β grows by G/(G − 1)); "turned" — divided by a standard deviation of the
# returns, which is not linear in them: the direction changes (cosine 0.977 on the test policy, with the
# norm × 0.31), and with it the fixed point.
REWARD_KL_UNDER_ADVANTAGE: dict[str, str] = {
    "reinforce/none": "exact",
    "reinforce/loo": "exact",
    "rloo": "exact",
    "reinforce/batch_mean": "scaled",
    "dr_grpo": "scaled",
    "grpo": "turned",
    "reinforce_pp": "turned",
    "reinforce_pp_baseline": "turned",
}

# A task reward with a loss-placed KL beside it (k2, per-token unbiased), and ``kl.loss_scale``: what the expected
# gradient of the whole loss is against ∇(E_π[R] − β KL(π‖π_ref)), by exact enumeration (one token, groups of
# G = 2). "exact" — the gradient itself; "scaled" — (1 − 1/n) × it, the task reward and the KL scaled alike (the
# optimum kept); "reweighted" — the KL weighted by the advantages' own per-group factor, which depends on the
# samples: not proportional to the target, but its fixed point lies far closer to π* than without the option;
# "mismatched" — the two terms scaled differently (the KL's effective weight not β): the fixed point moves.
KL_LOSS_SCALE_UNDER_ADVANTAGE: dict[tuple[str, str], str] = {
    ("rloo", "none"): "exact",
    ("rloo", "advantage"): "exact",
    ("dr_grpo", "none"): "mismatched",  # the reward × (1 − 1/G), the KL × 1: β acts as β·G/(G − 1)
    ("dr_grpo", "advantage"): "scaled",
    ("reinforce/batch_mean", "none"): "mismatched",
    ("reinforce/batch_mean", "advantage"): "scaled",
    ("grpo", "none"): "mismatched",  # the reward ÷ the group's std, the KL not: β → 0 as the std shrinks
    ("grpo", "advantage"): "reweighted",
}

# Samples drawn by an engine whose numbers are not the trainer's (π_s ≠ π_t = π_old), and the sampler–trainer
# correction (``algorithm.tis_cap``, ``tis_mode=token_truncate``): is the expected gradient of each term the one under
# π_t? By exact enumeration, one token. The correction w = min(π_t/π_s, C) weighs the policy loss, so the task reward
# and a reward-placed KL (it is in the return) are corrected; the loss-placed KL term is weighed by the same w. With
# C above every ratio all three are exact; a binding cap truncates the largest ratios: biased (bounded variance).
SAMPLER_CORRECTION: dict[tuple[str, str], bool] = {
    ("task reward", "none"): False,
    ("task reward", "uncapped"): True,
    ("task reward", "binding cap"): False,
    ("k1 in the reward", "none"): False,
    ("k1 in the reward", "uncapped"): True,
    ("k1 in the reward", "binding cap"): False,
    ("k2 in the loss", "none"): False,
    ("k2 in the loss", "uncapped"): True,
    ("k2 in the loss", "binding cap"): False,
}

# A multi-turn trajectory x1, e(x1), x2 (rlhf_lab/envs/): the environment's token e is fixed by x1, so the
# trajectory's KL(π‖π_ref) is over the model's tokens only, and the policy's own probability of e (it predicts every
# position) must get no gradient. With the loss mask on the model's tokens each pair is what it is on two-token
# sequences; with the environment's token in the mask (``env.loss_on_env_tokens=true``) every pair is biased: e's
# log-ratio enters the return or the loss, and the score function pushes up a token the policy never chose.
MULTI_TURN_MASK: dict[tuple[str, str, str], bool] = {
    **{(*pair, "model tokens"): unbiased for pair, unbiased in SEQUENCE_KL_GRADIENT_UNBIASED.items()},
    **{(*pair, "all tokens"): False for pair in SEQUENCE_KL_GRADIENT_UNBIASED},
}


def zero_gradient_warning(estimator: str, placement: str) -> str | None:
    """The one-line warning for a pair whose expected gradient is zero, naming its table entry; else None."""
    advice = ZERO_KL_GRADIENT.get((estimator, placement))
    if advice is None:
        return None
    return (f"warning: kl={estimator} with kl.placement={placement} has zero expected KL gradient "
            f"(rlhf_lab.kl.REVERSE_KL_GRADIENT_UNBIASED[({estimator!r}, {placement!r})] is False): {advice}")


# Off-policy: samples of a behaviour policy μ ≠ π (a policy k updates stale, an engine with other numbers), the
# gradient wanted ∇KL(π‖π_ref) under π. A correction is the pair of options the trainer composes: the policy loss's
# weight ``algorithm.tis_mode`` (``none``; ``token_truncate``: sg(π/μ) per token; ``sequence_mask``: sg(Π_t π/μ) on
# every token; caps above every ratio here — a binding cap is biased, ``SAMPLER_CORRECTION``), which also weighs a
# loss-placed KL under ``kl.off_policy_correction=policy``; or the KL's own weight ``kl.off_policy_correction``
# (``token_ratio``: π/μ per token WITH gradient, DeepSeek-V3.2's unbiased k3, arXiv 2510.01555; ``prefix_ratio``:
# Π_{s≤t} π/μ, with gradient), for a loss-placed KL only. By exact enumeration (tests/unit/test_kl_truth_off_policy.py):
#   E_μ[sg(π/μ)·X] = E_π[X]: an sg weight moves the expectation to π and leaves each pair as it is on-policy.
#   ∇E_μ[(π/μ)·f] = ∇E_π[f]: a weight with gradient makes the VALUE the objective, so an estimator whose value is
#   unbiased (k1, k3, full) gets the exact gradient — k3 included, whose sg-weighted gradient is the forward KL's —
#   and one whose GRADIENT is the unbiased part (k2, k1_plus, k3_plus) gets a wrong one (k1_plus: twice the target).
#   Sequences: the prefix y_<t is μ's, so a per-token weight corrects only the last step; the sequence's weight
#   (``sequence_mask`` for the return, ``prefix_ratio`` for a loss) is needed, and with gradient its ∇ of the
#   prefix carries the KL to go.
OFF_POLICY_CORRECTIONS: dict[str, tuple[str, ...]] = {  # placement -> the corrections that act on its KL
    "reward": ("none", "token_truncate", "sequence_mask"),
    "loss": ("none", "token_truncate", "sequence_mask", "token_ratio", "prefix_ratio"),
}
_ONE_TOKEN_EXACT = {
    # the return's score function, importance-weighted: E_π[k1 ∇log π]
    *((name, "reward", c) for name in ("kl", "k1_plus", "sequence_k1") for c in ("token_truncate", "sequence_mask")),
    # one token's exact KL does not depend on the sampled token, and every weight here has mean 1 under μ
    *((name, "loss", c) for name in ("full", "sequence_full") for c in OFF_POLICY_CORRECTIONS["loss"]),
    # gradient-unbiased estimators under an sg weight
    *((name, "loss", c) for name in ("mse", "k1_plus", "k3_plus", "sequence_k1") for c in ("token_truncate", "sequence_mask")),
    # value-unbiased estimators under the weight with gradient
    *((name, "loss", c) for name in ("kl", "k3") for c in ("token_ratio", "prefix_ratio")),
}
_SEQUENCE_EXACT = {
    # the return's score function needs the whole sequence's weight: a token's weight leaves the prefix μ's
    ("kl", "reward", "sequence_mask"), ("k1_plus", "reward", "sequence_mask"), ("sequence_k1", "reward", "sequence_mask"),
    # the KL-to-go estimators need the sequence's sg weight (their own score-function term is on-policy exact)
    ("sequence_k1", "loss", "sequence_mask"), ("sequence_full", "loss", "sequence_mask"),
    # value-unbiased per-position estimators under the prefix's weight with gradient: Σ_t E_π[f_t] = KL(π‖π_ref)
    ("kl", "loss", "prefix_ratio"), ("k3", "loss", "prefix_ratio"), ("full", "loss", "prefix_ratio"),
}


def _off_policy_table(exact: set[tuple[str, str, str]], estimators: tuple[str, ...]) -> dict[tuple[str, str, str], bool]:
    return {(name, placement, correction): (name, placement, correction) in exact
            for name in estimators for placement, corrections in OFF_POLICY_CORRECTIONS.items()
            for correction in corrections}


_ESTIMATORS = tuple(sorted({name for name, _ in REVERSE_KL_GRADIENT_UNBIASED}))
# (estimator, placement, correction) -> is E_μ[gradient] = ∇KL(π‖π_ref) for ONE token sampled from μ ≠ π?
OFF_POLICY_KL_GRADIENT: dict[tuple[str, str, str], bool] = _off_policy_table(_ONE_TOKEN_EXACT, _ESTIMATORS)
# ... and of whole two-token SEQUENCES sampled from μ (the reward-placed penalties summed into the return)?
OFF_POLICY_SEQUENCE_KL_GRADIENT: dict[tuple[str, str, str], bool] = _off_policy_table(_SEQUENCE_EXACT, _ESTIMATORS)


# Micro-batches: a mini-batch's loss cut into micro-batches whose gradients are accumulated (``trainer.
# micro_batch_size``, or any cut of the rows). (loss_aggregation, normaliser) -> is the accumulated expected gradient
# of the whole loss (policy loss + a loss-placed KL reduced the same way) the same for EVERY cut of the batch? By
# exact enumeration (tests/unit/test_kl_truth_micro_batch.py: every batch of three variable-length responses, every
# cut). "mini-batch": the aggregation divides by the mini-batch's totals (``LossContext``, what the trainer passes)
# — every cut gives the one gradient; "micro-batch": by each micro-batch's own tokens or rows — the gradient then
# depends on the cut (a short response in a small micro-batch weighs more).
MICRO_BATCH_INVARIANCE: dict[tuple[str, str], bool] = {
    **{(aggregation, "mini-batch"): True for aggregation in ("token_mean", "sequence_mean", "sequence_sum_constant")},
    **{(aggregation, "micro-batch"): False for aggregation in ("token_mean", "sequence_mean", "sequence_sum_constant")},
}


# The policy loss's off-policy corrections (``algorithm.tis_mode``, ``policy_loss=dppo``, ``algorithm.off_policy_mask``)
# for the task reward, under asynchronous sampling: is E_μ[∇ surrogate] = ∇E_π[R] (π = π_old = π_θ at the update's
# first step, every threshold above every ratio)? By exact enumeration (tests/unit/test_policy_correction_truth.py):
# one token from μ; two-token sequences whose tokens two policy versions sampled (x1 ~ μ_a, x2 ~ μ_b(·|x1)) with each
# token's own sampler log-prob ("per-token versions"), and the same samples scored with the first version's log-probs
# for both tokens ("one version per sample": what a trainer that records one version per sample computes).
#   A token's weight π/μ corrects only its own step: the prefix stays μ's, so token-level weights (TIS, AReaL's
#   decoupled PPO, IcePop, M2PO's kept tokens, DPPO's ratio) are exact for one token, not for sequences; the
#   sequence's Π_t π/μ_t is exact for sequences — with every token's own version's μ, not one version's. Geo-RS and
#   the V3.2 mask only remove samples (no weight): uncorrected. A binding threshold (``binding``: IcePop's band
#   [0.9, 1.1], M2PO's τ = 0.01, a cap of 1.05) is biased in every setting. DPPO here with τ = 0 (its
#   τ·(log π/μ)² term pulls π towards μ: biased by design).
POLICY_CORRECTIONS: tuple[str, ...] = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                       "icepop", "geo_mask", "m2po", "dppo", "off_policy_mask")
CORRECTION_SETTINGS: tuple[str, ...] = ("one token", "per-token versions", "one version per sample", "binding")
_POLICY_EXACT = {
    *((name, "one token") for name in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                                       "m2po", "dppo")),
    ("sequence_truncate", "per-token versions"), ("sequence_mask", "per-token versions"),
}
POLICY_CORRECTION_GRADIENT: dict[tuple[str, str], bool] = {
    (name, setting): (name, setting) in _POLICY_EXACT for name in POLICY_CORRECTIONS for setting in CORRECTION_SETTINGS}
