"""Evaluation on held-out prompts, one code path for training's periodic evaluation and ``rlhf-lab eval``.

Settings (``eval.*``, each defaulting to training's): ``eval.prompts`` (``trainer.eval_prompts``),
``eval.samples_per_prompt`` (1), ``eval.temperature`` / ``eval.top_p`` (``trainer.*``), ``eval.greedy`` (the most
likely token at every position: sampling restricted to top-k = 1 at temperature 1). Metrics (``eval/``):
``reward/mean|std`` under the run's reward, ``kl/estimate``, ``kl/exact`` (per token, from full logits) and
``kl/exact_sequence`` (per response), ``response/length_mean``, ``distinct_2``; with ``eval.rewards=[length,...]``
each extra reward's ``reward/<name>/mean`` (a second opinion that catches reward hacking); with
``eval.win_rate=true`` the reference policy answers the same prompts and ``win_rate`` is the share of prompts
where the policy's response scores higher under ``eval.win_rate_reward`` (default: the run's reward; ties
count half). With ``eval.samples_per_prompt`` = G > 1: ``group_distinct_1|2`` (one prompt's responses), and with
``eval.pass_threshold`` set, ``pass@k`` for k in 1, 4, 16 up to G (:mod:`rlhf_lab.training.diversity`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_lab.data.prompts import EVAL_CHUNK
from rlhf_lab.masked import masked_sum
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.step.ahead import rng_key
from rlhf_lab.training.diversity import group_metrics
from rlhf_lab.training.records import distinct_n


def shard(count: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous block of ``range(count)`` (the first ``count % world_size`` ranks take one more)."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


@dataclass
class EvalSettings:
    prompts: int
    samples_per_prompt: int
    temperature: float
    top_p: float
    top_k: int
    rewards: list[str]
    win_rate: bool
    win_rate_reward: str | None
    pass_threshold: float | None = None


def settings(cfg: Any) -> EvalSettings:
    """``eval.*`` with training's values where unset (a config without ``eval``: training's throughout)."""
    node = cfg.get("eval") or {}
    trainer = cfg.trainer

    def pick(key: str, default: Any) -> Any:
        value = node.get(key) if hasattr(node, "get") else None
        return default if value is None else value

    greedy = bool(pick("greedy", False))
    return EvalSettings(
        prompts=int(pick("prompts", trainer.eval_prompts)),
        samples_per_prompt=int(pick("samples_per_prompt", 1)),
        temperature=1.0 if greedy else float(pick("temperature", trainer.temperature)),
        top_p=1.0 if greedy else float(pick("top_p", trainer.top_p)),
        top_k=1 if greedy else int(trainer.get("top_k", 0)),
        rewards=[str(name) for name in pick("rewards", [])],
        win_rate=bool(pick("win_rate", False)),
        win_rate_reward=pick("win_rate_reward", None),
        pass_threshold=pick("pass_threshold", None),
    )


def sampling_config(cfg: Any, chosen: EvalSettings) -> Any | None:
    """A copy of ``cfg`` whose ``trainer`` samples as ``chosen`` says, or None when that is training's sampling."""
    trainer = cfg.trainer
    if (chosen.temperature, chosen.top_p, chosen.top_k) == (trainer.temperature, trainer.top_p,
                                                             trainer.get("top_k", 0)):
        return None
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    copy.trainer.temperature, copy.trainer.top_p, copy.trainer.top_k = chosen.temperature, chosen.top_p, chosen.top_k
    return copy


def reward_config(name: str, search_paths: tuple[str, ...] = ()) -> Any:
    """The config of reward option ``name`` (``conf/reward/NAME.yaml``), for an eval-only reward."""
    from rlhf_lab.config.compose import _hydra_compose
    from rlhf_lab.config.sweep_jobs import searchpath_override

    return _hydra_compose([f"reward={name}", *searchpath_override(search_paths)]).reward


def in_lockstep(maker: Any) -> bool:
    """Whether every rank must sample as many times as every other: sharded weights (FSDP), or an engine whose
    tensor-parallel group spans ranks (``generation.tensor_parallel_size`` > 1)."""
    tensor_parallel = getattr(maker.engine, "tensor_parallel", None)
    return getattr(tensor_parallel, "size", 1) > 1 or any(map(distributed.sharded, maker.policy.parameters()))


class Evaluation:
    """What an evaluation needs besides the policy's experience maker: its own sampling, extra rewards, and the
    reference's maker for the win rate. Built once per run (:meth:`from_parts`)."""

    def __init__(self, chosen: EvalSettings, maker: Any, extra_rewards: dict[str, Any],
                 reference_maker: Any = None, reference_context: Callable[[], Any] | None = None,
                 win_reward: Any = None) -> None:
        self.settings, self.maker, self.extra_rewards = chosen, maker, extra_rewards
        self.reference_maker, self.reference_context, self.win_reward = reference_maker, reference_context, win_reward

    @classmethod
    def from_parts(cls, cfg: Any, experience: Any, make_maker: Callable[[Any, Any, Any], Any], models: Any,
                   build_reward: Callable[[Any], Any]) -> Evaluation:
        """``experience``: training's maker; ``make_maker(cfg, policy, worker)`` another one sampling through
        ``worker``; ``build_reward(reward_cfg)``. Every maker samples through ``experience``'s engine (the reference's
        through it with the adapter off, or through the hf engine: :meth:`ExperienceMaker.reference_worker`), so an
        evaluation never builds a second vLLM engine."""
        chosen = settings(cfg)
        eval_cfg = sampling_config(cfg, chosen)
        maker = experience if eval_cfg is None else make_maker(eval_cfg, experience.policy, experience.worker)
        extra = {name: build_reward(reward_config(name)) for name in chosen.rewards}
        reference_maker = win_reward = None
        if chosen.win_rate:
            reference_cfg, reference = eval_cfg if eval_cfg is not None else cfg, models.reference_model()
            reference_maker = make_maker(reference_cfg, reference, experience.reference_worker(reference_cfg, reference))
            win_name = chosen.win_rate_reward
            win_reward = experience.reward if not win_name else build_reward(reward_config(win_name))
        return cls(chosen, maker, extra, reference_maker, models.reference_context, win_reward)

    @torch.no_grad()
    def run(self, prompts: list[str], step: int, seed: int, kl_coef: float) -> tuple[dict[str, Any], list[tuple]]:
        """Metrics on ``prompts`` (sharded over ranks) and the (prompt, response, reward) examples, in order; each
        example's prompt is the one the model saw (an environment's opening conversation for episodes)."""
        group = self.settings.samples_per_prompt
        positions = shard(len(prompts), distributed.rank(), distributed.world_size())
        real = len(positions) * group  # this rank's samples
        if in_lockstep(self.maker):
            # FSDP (a forward pass is a collective) or an engine shared by a tensor-parallel group (its ranks send
            # the group's requests together): every rank generates as often as the rank with the most prompts; the
            # padding (repeats of a prompt) is generated and dropped.
            width = -(-len(prompts) // distributed.world_size())
            positions = positions + [positions[-1] if positions else 0] * (width - len(positions))
        timer, started, chunks = StepTimer(), time.perf_counter(), -(-len(positions) // EVAL_CHUNK)
        if distributed.is_main_process():  # a first evaluation under load takes a minute: say it started
            say(f"evaluation at step {step}: {len(prompts)} held-out prompts × {group} "
                f"sample{'s' if group > 1 else ''}", __name__)
        scores, valid, estimates, exacts, lengths, texts, asked = [], [], [], [], [], [], []
        extra: dict[str, list[torch.Tensor]] = {name: [] for name in self.extra_rewards}
        wins: list[torch.Tensor] = []
        for start in range(0, len(positions), EVAL_CHUNK):
            chunk = positions[start : start + EVAL_CHUNK]
            chunk_prompts = [prompts[i] for i in chunk]
            names = [f"eval prompt {i}" for i in chunk]
            keys = [rng_key(seed, 1, step, i) for i in chunk]
            experience = self.maker.make(chunk_prompts, group, timer, names, kl_coef, rng_keys=keys)
            rollout, mask = experience.rollout, experience.rollout.response_mask
            scores.append(rollout.scores)
            valid.append(experience.valid)  # dropped (non-finite) scores count in no eval mean
            estimates.append(masked_sum(rollout.kl_estimate, mask, dim=-1))
            exact = rollout.kl_exact if rollout.kl_exact is not None else torch.full_like(mask, math.nan)  # kl.exact=off
            exacts.append(masked_sum(exact, mask, dim=-1))
            lengths.append(mask.sum(-1))
            texts += experience.responses
            asked += experience.prompts  # what the model saw: an environment's opening, not the data row
            for name, reward in self.extra_rewards.items():
                extra[name].append(reward(experience.prompts, experience.responses).scores)
            if self.reference_maker is not None:
                wins.append(self._wins(experience, chunk_prompts, names, keys, timer))
            if chunks > 1 and distributed.is_main_process():
                done = min(start + EVAL_CHUNK, len(positions))
                say(f"evaluation at step {step}: {done}/{len(positions)} prompts ({time.perf_counter() - started:.0f} s)",
                    __name__)
        all_shown, all_valid, all_lengths, estimates, exacts = (
            torch.cat(values)[:real] for values in (scores, valid, lengths, estimates, exacts))
        all_scores, texts, asked, tokens = all_shown[all_valid], texts[:real], asked[:real], all_lengths.sum()
        extra_scores = {name: torch.cat(values)[:real] for name, values in extra.items()}
        all_wins = torch.cat(wins)[:real] if wins else None
        if distributed.world_size() > 1:  # every rank's results, in rank order
            all_scores, all_shown, all_lengths, estimates, exacts = (
                torch.tensor(distributed.gather_objects(t.tolist()))
                for t in (all_scores, all_shown, all_lengths, estimates, exacts)
            )
            tokens = all_lengths.sum()
            extra_scores = {k: torch.tensor(distributed.gather_objects(v.tolist())) for k, v in extra_scores.items()}
            if all_wins is not None:
                all_wins = torch.tensor(distributed.gather_objects(all_wins.tolist()))
            texts = distributed.gather_objects(texts)
            asked = distributed.gather_objects(asked)
        total_tokens = tokens.sum()
        examples = list(zip(asked, texts, all_shown.tolist()))
        if not len(all_scores):
            all_scores = torch.full((1,), float("nan"))
        metrics = {
            "eval/reward/mean": all_scores.mean().item(),
            "eval/reward/std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
            "eval/kl/estimate": (estimates.sum() / total_tokens).item(),
            **({"eval/kl/exact": (exacts.sum() / total_tokens).item()} if not exacts.isnan().any() else {}),
            "eval/response/length_mean": all_lengths.mean().item(),
            "eval/distinct_2": distinct_n(texts, 2),
        }
        metrics.update(group_metrics(all_shown, texts, group, self.settings.pass_threshold))  # pass@k, group distinct-n
        if (group > 1 or self.extra_rewards or all_wins is not None) and "eval/kl/exact" in metrics:
            metrics["eval/kl/exact_sequence"] = exacts.sum().item() / max(len(all_lengths), 1)
        for name, values in extra_scores.items():
            metrics[f"eval/reward/{name}/mean"] = values.float().mean().item()
        if all_wins is not None:
            metrics["eval/win_rate"] = all_wins.float().mean().item()
        return metrics, examples

    def _wins(self, experience: Any, prompts: list[str], names: list[str], keys: list[int], timer: StepTimer) -> Any:
        """1 where the policy's sample beats the reference's sample for the same prompt and draw, ½ on a tie."""
        group = self.settings.samples_per_prompt
        context = self.reference_context() if self.reference_context is not None else nullcontext()
        with context:
            _, reference_responses, _ = self.reference_maker.sample_and_score(prompts, group, timer, names, keys)
        policy_scores = self.win_reward(experience.prompts, experience.responses).scores
        reference_scores = self.win_reward(experience.prompts, reference_responses).scores
        return (policy_scores > reference_scores).float() + 0.5 * (policy_scores == reference_scores).float()
