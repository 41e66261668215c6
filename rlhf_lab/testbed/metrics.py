"""Exact metrics of the exact task, by enumerating all V^T responses in one batched forward pass.

With π(y) the policy's sequence probability, π_ref the reference's, R the reward and β = ``kl.coef``:

    J(π) = E_π[R] − β·KL(π‖π_ref)                      exact/objective
    π*(y) = π_ref(y)·exp(R(y)/β) / Z,  J* = β·log Z    the regularised optimum (exact/optimal_objective)
    J* − J(π) = β·KL(π‖π*) ≥ 0                         exact/gap, and KL(π‖π*) itself: exact/kl_to_optimal
    J* − J(π_ref) = J* − E_π_ref[R]                    exact/gap_initial: the gap the run starts from (the policy
                                                       starts as π_ref), against which a run has diverged
    KL(π‖π_ref), KL(π*‖π_ref)                           exact/kl_sequence, exact/kl_optimal
    E_π[R], ½ Σ_y |π(y) − π*(y)|                        exact/reward, exact/tv_to_optimal
    E_π[Σ_t estimate_t] − KL(π‖π_ref)                  exact/kl_estimate_bias (the run's estimator's value,
                                                       in expectation: 0 for k1, k3, full and their variants)

(β = 0: π* spreads π_ref over the best responses and J* = max R.) The entropy and, with several equally
rewarded optimal responses, how π splits its mass over them: :mod:`rlhf_lab.testbed.modes`. The trainer calls
:func:`exact_step_metrics` after every step; it returns ``{}`` unless the run's model is ``exact``.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.kl import estimate
from rlhf_lab.registry import get
from rlhf_lab.runtime import distributed
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs
from rlhf_lab.testbed.modes import mode_metrics
from rlhf_lab.testbed.task import PROMPT, all_responses, response_mask, symbols, token_ids

ENUMERATION_CHUNK = 4096  # responses per forward pass


def regularised_optimum(ref_sequence_logprobs: Tensor, rewards: Tensor, beta: float) -> tuple[Tensor, float]:
    """(log π*(y) [N], J*) for J(π) = E_π[R] − β·KL(π‖π_ref): π* ∝ π_ref·exp(R/β), J* = β·log Σ π_ref·exp(R/β).

    β = 0 is the limit: π* is π_ref restricted to the responses of maximal reward, J* = max R.
    """
    ref = ref_sequence_logprobs.double()
    rewards = rewards.double()
    if beta > 0:
        logits = ref + rewards / beta
        log_partition = torch.logsumexp(logits, 0)
        return logits - log_partition, float(beta * log_partition)
    best = rewards.max()
    on_best = torch.where(rewards >= best, ref, torch.full_like(ref, -math.inf))
    return on_best - torch.logsumexp(on_best, 0), float(best)


def exact_metrics(logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float,
                  estimates: Tensor | None = None, lengths: Tensor | None = None) -> dict[str, float]:
    """The ``exact/*`` metrics from every response's per-token log-probs under the policy and the reference
    ([N, T] each, all N = V^T responses), their rewards [N] and β; ``estimates`` [N, T]: the run's estimator's
    per-token values on every response, for its expected bias; ``lengths`` [N]: each response's tokens, where they
    differ (``model.exact.stop``), for the policy's mean length against the optimum's. Computed in float64."""
    log_policy = logprobs.double().sum(-1)
    log_ref = ref_logprobs.double().sum(-1)
    rewards = rewards.double()
    policy = log_policy.exp()
    kl = float((policy * (log_policy - log_ref)).sum())
    reward = float((policy * rewards).sum())
    log_optimal, optimal_objective = regularised_optimum(log_ref, rewards, beta)
    optimal = log_optimal.exp()
    on_support = optimal > 0
    kl_optimal = float((optimal[on_support] * (log_optimal - log_ref)[on_support]).sum())
    objective = reward - beta * kl
    metrics = {
        "exact/objective": objective,
        "exact/optimal_objective": optimal_objective,
        "exact/gap": optimal_objective - objective,
        "exact/gap_initial": optimal_objective - float((log_ref.exp() * rewards).sum()),
        "exact/kl_sequence": kl,
        "exact/kl_optimal": kl_optimal,
        "exact/reward": reward,
        "exact/reward_optimal": float((optimal * rewards).sum()),
        "exact/tv_to_optimal": 0.5 * float((policy - optimal).abs().sum()),
        # KL(π‖π*) directly (β = 0: infinite where π leaves π*'s support, so from the log-probs on it).
        "exact/kl_to_optimal": float((policy * (log_policy - log_optimal)).sum()) if bool(on_support.all())
        else float("inf") if bool((policy[~on_support] > 0).any()) else float(
            (policy[on_support] * (log_policy - log_optimal)[on_support]).sum()),
        "exact/total_probability": float(policy.sum()),  # 1 up to rounding: the enumeration is complete
    }
    metrics.update(mode_metrics(log_policy, log_optimal, log_ref, rewards))  # entropy; the optimal modes' split
    if lengths is not None:  # whether the run learned a length π* does not have (a drop policy's bias)
        metrics["exact/length"] = float((policy * lengths.double()).sum())
        metrics["exact/length_bias"] = metrics["exact/length"] - float((optimal * lengths.double()).sum())
    if estimates is not None:
        expected = float((policy * estimates.double().sum(-1)).sum())
        metrics["exact/kl_estimate_expected"] = expected
        metrics["exact/kl_estimate_bias"] = expected - kl
    return metrics


def enumerate_logits(model: nn.Module, tokenizer: Any, responses: Tensor, temperature: float) -> Tensor:
    """Temperature-scaled logits predicting every token of every response ([N, T] symbol indices) after the
    prompt: [N, T, vocabulary], in chunks of ``ENUMERATION_CHUNK`` responses (the scoring pass's code)."""
    device = next(model.parameters()).device
    pieces = []
    for start in range(0, responses.shape[0], ENUMERATION_CHUNK):
        chunk = token_ids(responses[start : start + ENUMERATION_CHUNK]).to(device)
        prompt = torch.full((chunk.shape[0], 1), tokenizer.convert_tokens_to_ids(PROMPT), device=device)
        input_ids = torch.cat([prompt, chunk], dim=1)
        logits, _ = response_logits(model, input_ids, torch.ones_like(input_ids), 1, temperature)
        pieces.append(logits.float())
    return torch.cat(pieces)


class ExactEvaluator:
    """A run's exact metrics: the trajectories, their rewards and the reference's logits are computed once (the
    reference does not train); each call runs the policy over every trajectory.

    One-turn task: every response, scored by the run's own reward. Under an environment that can enumerate its
    trajectories (``env=exact_two_turn``, :mod:`rlhf_lab.testbed.two_turn`): its sequences, with the environment's
    tokens as context and the model's tokens alone counted, and its own rewards."""

    def __init__(self, trainer: Any) -> None:
        cfg = trainer.cfg
        self.trainer = trainer
        self.beta = float(cfg.kl.coef)
        self.temperature = float(cfg.trainer.temperature)
        env_cfg = cfg.get("env") or {"name": "single_turn"}
        env = get("env", env_cfg["name"])(env_cfg)
        stop = bool(cfg.model.exact.get("stop", False))
        self.stop = stop and not hasattr(env, "enumerate")  # responses of several lengths
        if hasattr(env, "enumerate"):
            self.sequences, self.positions, rewards = env.enumerate()
            self.mask = torch.ones(self.sequences[:, self.positions].shape)
        else:
            symbol_count = cfg.model.exact.symbols
            # [N, T]; with model.exact.stop the canonical rows, each response's tokens up to its first stop symbol
            self.sequences = all_responses(symbol_count, cfg.trainer.max_new_tokens, stop)
            self.mask = response_mask(self.sequences, symbol_count, stop)
            self.positions = torch.arange(self.sequences.shape[1])
            # R(y) from the run's own reward on every decoded response (any deterministic reward works).
            names = symbols(symbol_count)
            texts = [" ".join(names[i] for i in row) for row in self.sequences.tolist()]
            rewards = trainer.reward([PROMPT] * len(texts), texts).scores
        self.rewards = rewards.double()
        self.response_ids = token_ids(self.sequences[:, self.positions]).to(trainer.device)
        self.mask = self.mask.to(trainer.device)
        self.estimator = get("kl", cfg.kl.name)
        models = trainer.models
        with torch.no_grad(), models.reference_context(), trainer.precision.autocast():
            self.ref_logits = self._model_logits(models.reference_model())
        self.ref_logprobs = gather_logprobs(self.ref_logits, self.response_ids) * self.mask

    def _model_logits(self, model: nn.Module) -> Tensor:
        """Logits predicting each model token of every trajectory: [N, model tokens, vocabulary]."""
        logits = enumerate_logits(model, self.trainer.tokenizer, self.sequences, self.temperature)
        return logits[:, self.positions.to(logits.device)]

    @torch.no_grad()
    def policy(self) -> tuple[Tensor, Tensor]:
        """The policy's logits [N, T, vocabulary] and per-token log-probs [N, T] on every trajectory's model
        tokens, now (0 past a response's end)."""
        trainer = self.trainer
        with trainer.precision.autocast():
            logits = self._model_logits(distributed.unwrap(trainer.policy))
        return logits, gather_logprobs(logits, self.response_ids) * self.mask

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        start = time.perf_counter()
        logits, logprobs = self.policy()
        estimates = estimate(self.estimator, logprobs, self.ref_logprobs, logits=logits,
                             ref_logits=self.ref_logits) * self.mask
        lengths = self.mask.sum(-1).cpu() if self.stop else None
        metrics = exact_metrics(logprobs, self.ref_logprobs, self.rewards, self.beta, estimates, lengths)
        metrics["time/exact_s"] = time.perf_counter() - start
        return metrics


_EVALUATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def exact_step_metrics(trainer: Any, step: int) -> dict[str, float]:
    """The trainer's hook after step ``step``'s update: the ``exact/*`` metrics of the updated policy every
    ``trainer.exact_every`` steps and at the last step when the model is ``exact``; ``{}`` otherwise."""
    cfg = trainer.cfg
    if cfg.model.name != "exact":
        return {}
    every, last = cfg.trainer.exact_every, step + 1 == cfg.trainer.steps
    if not (last or (every > 0 and (step + 1) % every == 0)):
        return {}
    if trainer not in _EVALUATORS:
        _EVALUATORS[trainer] = ExactEvaluator(trainer)
    return _EVALUATORS[trainer]()
