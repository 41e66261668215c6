"""Experience: prompts -> generate (the engine's :class:`Samples`) -> score -> reference log-probs -> per-token KL
terms -> a :class:`Scored` batch, made here alone: each pass's results go in with :func:`dataclasses.replace`.

The scored batch keeps the sequence scores (``scores``, [B]) and the KL terms apart: ``kl_estimate`` is the
configured estimator's per-token value, ``kl_exact`` the exact per-token KL from full logits (a diagnostic,
logged beside every estimate), and ``kl_penalty`` what the KL placement takes out of the token rewards
(coef × estimate for ``kl.placement=reward``, zeros for ``loss``). The algorithm builds its token rewards
from these once (:meth:`rlhf_lab.algorithms.base.Algorithm.prepare`), on the training batch made from it
(:meth:`Scored.for_training`, a :class:`Rollout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.data.prompts import format_prompts
from rlhf_lab.envs.episodes import EpisodeRunner
from rlhf_lab.errors import ConfigError, RewardError
from rlhf_lab.generation.backend import GenerationBackend, SamplingSettings
from rlhf_lab.generation.inflight import inflight_settings, staleness_cap
from rlhf_lab.generation.rollout import Rollout, Samples, Scored, concat_rollouts
from rlhf_lab.generation.served_groups import continuous_engine
from rlhf_lab.generation.staleness import snapshot_ring
from rlhf_lab.generation.sync_check import SyncCheck, tolerance
from rlhf_lab.generation.worker import RolloutWorker
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.masked import masked_sum
from rlhf_lab.models.loading import PolicyAndReference
from rlhf_lab.registry import get
from rlhf_lab.rewards.base import Reward, fill_nonfinite
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.scoring.logprobs import needs_float32_logits
from rlhf_lab.step.ahead import sampled_behind
from rlhf_lab.step.compute import head_chunk
from rlhf_lab.step.sampling import SamplingRules, informative_groups, overlong_penalty, truncated
from rlhf_lab.step.scoring_pass import BatchScoring, ScoringPass, ScoringPlan

# ``refill(round, count)`` -> (prompts, names, rng_keys) of ``count`` further prompts (dynamic sampling).
Refill = Callable[[int, int], tuple[list[str], list[str], list[int] | None]]


@dataclass
class Experience:
    """A scored rollout with what produced it: the prompt of every sample, the decoded responses, and which
    samples have a finite score ([B] bool; the others were filled under ``reward.on_nonfinite=drop``)."""

    rollout: Scored | Rollout  # as made here: Scored; the run's step trains on its Rollout (Scored.for_training)
    prompts: list[str]  # one per sample (each prompt repeated group_size times)
    responses: list[str]
    valid: Tensor  # [B] bool
    in_loss: Tensor | None = None  # [B] bool: samples whose tokens enter the loss (None: the valid ones)
    stats: dict[str, float] = field(default_factory=dict)  # this rank's sampling counts (DAPO's rules)


LARGEST_SCORE = 1e15  # beyond it a batch's float32 statistics (a group's variance) overflow and zero the advantages


def screen_scores(scores: Tensor, components: dict[str, Tensor], names: list[str], group_size: int,
                  on_nonfinite: str, reward_name: str) -> tuple[Tensor, Tensor]:
    """NaN/inf scores: a one-line RewardError (``on_nonfinite=error``) or filled and marked invalid (``drop``).
    Scores no run can learn from are a RewardError either way: finite ones beyond ±``LARGEST_SCORE``, and a batch
    with no finite score at all (``drop`` would train on nothing).

    Returns (scores [B], valid [B] bool). ``names[i]`` says where prompt i comes from, for the message.
    """
    valid = torch.isfinite(scores)
    huge = valid & (scores.abs() > LARGEST_SCORE)
    if bool(huge.any()):
        sample = int(huge.nonzero()[0])
        raise RewardError(f"{reward_name} returned {float(scores[sample]):g} for sample {sample} "
                          f"({names[sample // group_size]}); scores beyond ±{LARGEST_SCORE:g} overflow the advantage "
                          "statistics: rescale the reward", sample=sample)
    if bool(valid.all()):
        return scores, valid
    if not bool(valid.any()) and on_nonfinite == "drop":
        raise RewardError(f"{reward_name} returned no finite score for any of the {len(scores)} samples "
                          f"({names[0]}, ...): reward.on_nonfinite=drop would train on nothing")
    if on_nonfinite == "error":
        sample = int((~valid).nonzero()[0])
        culprits = [key for key, values in components.items() if not math.isfinite(float(values[sample]))]
        source = f"component {', '.join(map(repr, culprits))} of {reward_name}" if culprits else reward_name
        raise RewardError(
            f"{source} returned {float(scores[sample])} for sample {sample} ({names[sample // group_size]}); "
            "reward.on_nonfinite=drop drops such samples instead",
            sample=sample,
        )
    return fill_nonfinite(scores, group_size)


class ExperienceMaker:
    """Turns prompts into scored rollouts with reference log-probs and KL terms (no gradient anywhere).

    ``policy`` is the network that generates (unwrapped from DDP); every forward pass runs under the run's
    precision. ``trainer.seed_per_prompt`` samples each prompt group from its own generator, so the samples
    do not depend on how prompts are batched or sharded over ranks. The scoring pass (:mod:`.scoring_pass`) runs
    the reference, and the training model where the engine's log-probs are not the trainer's, over row chunks.
    """

    def __init__(self, cfg: Any, tokenizer: Any, models: PolicyAndReference, policy: nn.Module, reward: Reward,
                 kl: KLPenalty, device: torch.device, precision: Precision | None = None,
                 keep_hidden: bool = False, hardware: HardwareProfile | None = None,
                 worker: RolloutWorker | None = None, sync_probe: str | None = None) -> None:
        self.cfg, self.tokenizer, self.models, self.policy = cfg, tokenizer, models, policy
        self.reward, self.kl, self.device = reward, kl, device
        self.precision = precision or Precision("fp32", device.type)
        self.hardware = hardware or HardwareProfile()
        # The update needs the reference's full logits only for a logits-based estimator placed in the loss.
        self.update_needs_ref_logits = kl.loss_reads_ref_logits
        # The sampling policy's and the reference's full logits: float32 for a temperature or an estimator reading them.
        self.logits_float32 = needs_float32_logits(cfg.trainer.temperature, kl.reads_logits)
        # π_old from a pass of the training model where the engine's log-probs are not the trainer's (scoring_pass.py).
        engine_class = get("generation", cfg.generation.name)
        # A multi-turn environment (env=NAME, rlhf_lab/envs/): episodes instead of one response per sample; the
        # scoring pass gives their π_old, entropies and logits (an engine samples their turns apart).
        env_cfg = cfg.get("env") or {"name": "single_turn"}
        env = get("env", env_cfg["name"])(env_cfg)
        make_runner = getattr(env, "make_runner", None)  # an environment with its own rollout loop (env=verifiers)
        self.episodes = None if env.single_turn else (make_runner(tokenizer, cfg) if make_runner
                                                      else EpisodeRunner(env, tokenizer, cfg))
        self.rescale = get("reward_rescale", cfg.reward.get("rescale", "none"))  # rlhf_lab/rewards/rescale.py
        self.keep_hidden = keep_hidden
        # Where π_old, the entropy and PPO's values come from, decided once (scoring_pass.ScoringPlan).
        self.plan = ScoringPlan.from_config(cfg, engine_class, self.precision, kl, keep_hidden,
                                            episodes=self.episodes is not None)
        self.exact_kl = cfg.kl.get("exact", "step")  # kl.exact: step | eval | off
        # The engine that samples (generation=NAME); it keeps the decode's last hidden states for PPO's shared critic
        # where its numbers are the trainer's, else the scoring pass does.
        # ``worker``: another maker's, shared (an evaluation's maker with its own sampling settings, same weights).
        self.settings = SamplingSettings.from_config(cfg)
        if worker is None:
            engine = engine_class(policy, tokenizer, self.settings, self.precision, self.hardware,
                                  options=cfg.generation, keep_logits=False,
                                  keep_hidden=keep_hidden and not self.plan.rescore, logits_float32=self.logits_float32)
            worker = RolloutWorker(engine, policy, self._sync_check(engine, sync_probe), snapshot_ring(cfg, policy),
                                   inflight_settings(cfg), staleness_cap(cfg))
            # generation.continuous: the simulator's engine over the hf decode, or a server's stream of groups
            worker.continuous = continuous_engine(cfg, engine, lambda: worker.policy_version)
            if worker.continuous is not None:
                if distributed.world_size() > 1:
                    raise ConfigError(f"generation.continuous=true with {distributed.world_size()} ranks: the "
                                      "continuous engine takes one rank's groups; run it on one rank")
                worker.continuous.formatted = lambda prompt: self._request([prompt], None)[0][0]
        # The one owner of the engine's wake, weights, sampling and sleep (rlhf_lab/generation/worker.py).
        self.worker = worker
        self.engine: GenerationBackend = worker.engine
        self.scoring = ScoringPass(cfg, models, policy, kl, device, self.precision, keep_hidden, self.logits_float32)
        self.rules = SamplingRules.from_config(cfg.algorithm)
        # ReMax's advantage subtracts the greedy response's score: one extra greedy generation per prompt.
        advantage = cfg.algorithm.get("advantage")
        self.greedy_baseline = bool(advantage) and getattr(get("advantage", advantage), "needs_greedy_baseline", False)

    def keep_sampler_logits(self, exact: bool, sources: Any) -> None:
        """The engine keeps the sampler's own logits where the batch reads them and no rescoring pass gives them
        (the exact KL, a logits-reading estimator): as the LM head's inputs under ``trainer.chunked_logprobs``, with a
        copy of the head's weight where a batch is sampled by older weights than score it (sampled ahead, or with
        simulated staleness): the head's inputs are the sampler's, so its weight must be the sampler's too."""
        if not sources.rescore:
            self.engine.keep_logits = exact or self.kl.reads_logits
            if hasattr(self.engine, "head_chunk"):
                self.engine.head_chunk = head_chunk(self.cfg.trainer, self.device)
                self.engine.head_copy = sampled_behind(self.cfg)

    def reference_worker(self, cfg: Any, reference: nn.Module) -> Any:
        """Sampling for the reference (the evaluation's win rate), never a second engine: this maker's engine with the
        adapter off where it samples the base weights itself (LoRA on vLLM), else the hf engine over ``reference``'s
        own weights (under LoRA the policy, whose adapter ``models.reference_context`` turns off)."""
        if getattr(self.engine, "samples_base", False):
            return self.worker.adapter_off()
        engine = get("generation", "hf")(reference, self.tokenizer, SamplingSettings.from_config(cfg), self.precision,
                                          self.hardware)
        return RolloutWorker(engine, reference)

    def _sync_check(self, engine: GenerationBackend, probe: str | None) -> SyncCheck | None:
        """The weight-sync canary of an engine with weights of its own, probed with the start of ``probe``."""
        if not getattr(engine, "holds_weights", False) or probe is None:
            return None
        tol = tolerance((self.cfg.get("generation") or {}).get("sync_check_tol"), self.precision)
        return SyncCheck.from_prompt(self.tokenizer, probe, tol, self.precision, self.device)

    def make(self, prompts: list[str], group_size: int, timer: StepTimer, names: list[str],
             kl_coef: float, rng_keys: list[int] | None = None, train: bool = False,
             refill: Refill | None = None, then: Callable[[], None] | None = None) -> Experience:
        """Generate ``group_size`` samples per prompt, score them, run the reference, and fill the KL terms.

        ``names`` says where each prompt comes from (``train prompt 12``), for error messages; ``rng_keys``
        seed each prompt's generator under ``trainer.seed_per_prompt``. ``train`` applies the algorithm's
        sampling rules (overlong shaping, truncation mask, dynamic sampling through ``refill``) and ReMax's
        greedy baseline; evaluation runs without them. ``then`` runs once the samples are in, before the scoring
        passes (the next step's generation starts there under ``generation.max_staleness=1``).
        """
        exact = self.exact_kl == "step" if train else self.exact_kl != "off"
        sources = self.plan.for_batch(exact, train)
        self.keep_sampler_logits(exact, sources)
        if not train:
            rollout, responses, valid = self.sample_and_score(prompts, group_size, timer, names, rng_keys)
            experience = Experience(rollout, self._sample_prompts(prompts, group_size), responses,
                                    valid.to(self.device))
        else:
            with self.worker.lagging():  # generation.simulate_staleness: the weights of k updates before
                experience = self._training_batch(prompts, group_size, timer, names, rng_keys, refill)
            if self.greedy_baseline:
                self._greedy_baseline(experience, group_size, timer, names)
        if then is not None:
            then()
        experience.rollout = self.score(experience.rollout, timer, exact, sources, kl_coef, train)
        return experience

    def score(self, rollout: Scored, timer: StepTimer, exact: bool, sources: BatchScoring, kl_coef: float,
              train: bool = False) -> Scored:
        """The scored batch: the scoring pass's fields (reference, KL terms, π_old where it rescores), the rescaled
        scores of a training batch, the KL penalty, and where π_old and the entropy come from (``sources``)."""
        rollout = replace(rollout, **self.scoring(rollout, timer, exact, sources.rescore))
        if train:
            rollout = self._rescale(rollout, rollout.group_size, kl_coef)
        return replace(rollout, **self.kl.reward_terms(rollout, kl_coef), old_from_update=sources.old_from_update,
                       entropy_from_update=sources.entropy_from_update)

    def _rescale(self, rollout: Scored, group_size: int, kl_coef: float) -> Scored:
        """``reward.rescale`` on a training batch, with the reference's sequence log-probs, anchored per group or over
        the batch (``reward.rescale_anchor``): the scores trained on; the task's are logged too (``reward/task``)."""
        span = group_size if self.cfg.reward.get("rescale_anchor", "batch") == "group" else len(rollout.scores)
        rescaled = self.rescale(rollout.scores, masked_sum(rollout.ref_logprobs, rollout.response_mask, dim=-1),
                                span, kl_coef, self.cfg.reward.get("rescale_threshold"))
        if rescaled is rollout.scores:
            return rollout
        return replace(rollout, scores=rescaled, extras={**rollout.extras, "reward/task": rollout.scores})

    def _shaped(self, prompts: list[str], group_size: int, timer: StepTimer, names: list[str],
                rng_keys: list[int] | None, samples: Samples | None = None) -> Experience:
        """Sample (or take ``samples``) and score, then the overlong penalty on the scores and the truncation mask."""
        rollout, responses, valid = self.sample_and_score(prompts, group_size, timer, names, rng_keys, samples)
        rules, mask = self.rules, rollout.response_mask
        in_loss = valid.to(self.device)
        dropped = getattr(self.worker, "dropped", None)  # generation.staleness_cap with drop
        if dropped is not None:
            in_loss = in_loss & ~dropped.to(self.device)
        cut = rollout.truncated if rollout.truncated is not None else \
            truncated(rollout.response_ids, mask, self.tokenizer.eos_token_id)
        stats = {"truncated": float(cut.sum())}
        if rules.shapes_rewards:
            penalty = overlong_penalty(mask.sum(-1), self.cfg.trainer.max_new_tokens, rules.overlong_window,
                                       rules.overlong_factor).to(rollout.scores)
            rollout = replace(rollout, scores=rollout.scores + penalty,
                              extras={**rollout.extras, "reward/overlong_penalty": penalty})
        if rules.mask_truncated:
            in_loss = in_loss & ~cut
            stats["masked_truncated"] = float((valid.to(self.device) & cut).sum())
        return Experience(rollout, self._sample_prompts(prompts, group_size), responses, valid.to(self.device),
                          in_loss, stats)

    def _training_batch(self, prompts: list[str], group_size: int, timer: StepTimer, names: list[str],
                        rng_keys: list[int] | None, refill: Refill | None) -> Experience:
        """The step's batch under the sampling rules; with dynamic sampling only informative groups, refilled
        round by round, and at the round limit tied groups kept out of the loss in the missing places."""
        if self.worker.continuous is not None:  # generation.continuous: the groups that completed first
            with timer.phase("generate"):
                groups, samples = self.worker.take_groups(len(prompts))
            return self._shaped([g.prompt for g in groups], group_size, timer, [g.name for g in groups], None,
                                samples)
        first = self._shaped(prompts, group_size, timer, names, rng_keys)
        if not (self.rules.dynamic_sampling and refill is not None):
            return first
        wanted = len(prompts)
        kept: list[Experience] = []
        tied: list[Experience] = []
        stats = {"rounds": 1.0, "groups_dropped": 0.0, "refill_prompts": 0.0, "groups_filled": 0.0, **first.stats}
        batch, round_ = first, 0
        while True:
            informative = informative_groups(batch.rollout.scores, batch.valid, group_size)
            stats["groups_dropped"] += float((~informative).sum())
            for group, keep in enumerate(informative.tolist()):
                (kept if keep else tied).append(_select_groups(batch, [group], group_size))
            # Every rank takes the same rounds with the same number of prompts (the most any rank misses): under
            # FSDP a generation's forward passes are collectives. A rank that misses fewer keeps what it needs.
            count = int(distributed.maximum(torch.tensor(float(max(wanted - len(kept), 0)))))
            if round_ == 0 and count == 0:  # nothing dropped anywhere: the first batch as it is, not rebuilt
                first.stats = stats
                return first
            if count == 0 or round_ >= self.rules.max_refill_rounds:
                break
            round_ += 1
            more_prompts, more_names, more_keys = refill(round_, count)
            batch = self._shaped(more_prompts, group_size, timer, more_names, more_keys)
            stats["rounds"] += 1
            stats["refill_prompts"] += len(more_prompts)
            for key in ("truncated", "masked_truncated"):
                if key in batch.stats:
                    stats[key] += batch.stats[key]
        kept = kept[:wanted]
        for filler in tied[: wanted - len(kept)]:  # the round limit: tied groups hold the places, out of the loss
            filler.in_loss = torch.zeros_like(filler.in_loss)
            kept.append(filler)
            stats["groups_filled"] += 1
        return _join(kept, self.tokenizer.pad_token_id, stats)

    def _sample_prompts(self, prompts: list[str], group_size: int) -> list[str]:
        """Each sample's prompt, for the records: the prompt, or an episode's opening conversation (an environment
        that makes its own tasks from the data's prompts shows what the model was asked)."""
        if self.episodes is not None:
            return self.episodes.openings
        return [p for p in prompts for _ in range(group_size)]

    def _greedy_baseline(self, experience: Experience, group_size: int, timer: StepTimer, names: list[str]) -> None:
        """ReMax (Li et al. 2024): each prompt's greedy response, scored, as every sample's baseline [B]."""
        cfg = self.cfg
        prompts = experience.prompts[::group_size]
        formatted = format_prompts(prompts, self.tokenizer, cfg.model.chat_template, cfg.model.system_prompt)
        with timer.phase("generate_greedy"):
            greedy = self.worker.generate(formatted, 1, greedy=True, settings=self.settings)
        responses = self._decode(greedy)
        with timer.phase("reward"):
            output = self.reward(prompts, responses)
        scores, _ = screen_scores(output.scores, output.components, names, 1, "drop", self.reward.describe())
        experience.rollout = replace(experience.rollout,
                                     baseline_scores=scores.to(self.device).float().repeat_interleave(group_size))

    def _decode(self, rollout: Samples | Scored) -> list[str]:
        response_mask = rollout.response_mask.long()
        return self.tokenizer.batch_decode(
            rollout.response_ids * response_mask + (1 - response_mask) * self.tokenizer.pad_token_id,
            skip_special_tokens=True,
        )

    def generate(self, prompts: list[str], group_size: int, rng_keys: list[int] | None) -> Samples:
        """Sample the responses; each prompt group from its own seeded generator under ``seed_per_prompt``. The
        batch started ahead for these prompts (:meth:`generate_ahead`) where there is one."""
        rollout = self.worker.take(_ahead_key(prompts, group_size, rng_keys))
        if rollout is not None:
            return rollout
        formatted, seeds = self._request(prompts, rng_keys)
        return self.worker.generate(formatted, group_size, seeds=seeds, settings=self.settings)

    def generate_ahead(self, prompts: list[str], group_size: int, rng_keys: list[int] | None) -> None:
        """Start sampling a later step's batch with the policy's current weights; :meth:`generate` of the same
        prompts takes it (an engine on devices of its own samples it while this process trains)."""
        formatted, seeds = self._request(prompts, rng_keys)
        self.worker.launch(_ahead_key(prompts, group_size, rng_keys), formatted, group_size, seeds, self.settings)

    def _request(self, prompts: list[str], rng_keys: list[int] | None) -> tuple[list[str], list[int] | None]:
        cfg = self.cfg
        formatted = format_prompts(prompts, self.tokenizer, cfg.model.chat_template, cfg.model.system_prompt)
        return formatted, rng_keys if cfg.trainer.seed_per_prompt else None

    def sample_and_score(self, prompts: list[str], group_size: int, timer: StepTimer, names: list[str],
                         rng_keys: list[int] | None = None,
                         samples: Samples | None = None) -> tuple[Scored, list[str], Tensor]:
        """Generate (or take ``samples``, the engine's for ``prompts``) and score: (rollout with ``scores`` and
        reward components, decoded responses, valid [B])."""
        cfg = self.cfg
        if self.episodes is not None:  # the environment scores its own episodes
            with timer.phase("generate"), self.worker.awake():  # one wake for every turn of the batch
                return self.episodes.run(self.worker, self.settings, prompts, group_size, rng_keys, names, self.device)
        if samples is None:
            with timer.phase("generate"):
                samples = self.generate(prompts, group_size, rng_keys)
        responses = self._decode(samples)
        repeated_prompts = [p for p in prompts for _ in range(group_size)]
        with timer.phase("reward"):
            try:
                output = self.reward(repeated_prompts, responses)
            except RewardError as error:  # name the prompt the failing sample answered
                where = f" ({names[error.sample // group_size]})" if error.sample is not None else ""
                raise RewardError(f"{error}{where}", sample=error.sample) from None
        scores, valid = screen_scores(output.scores, output.components, names, group_size,
                                      cfg.reward.on_nonfinite, self.reward.describe())
        rollout = Scored.from_samples(samples, scores=scores.to(self.device).float(),
                                      extras={f"reward/{k}": v.to(self.device).float()
                                              for k, v in output.components.items()})
        return rollout, responses, valid


def _ahead_key(prompts: list[str], group_size: int, rng_keys: list[int] | None) -> tuple[Any, ...]:
    return tuple(prompts), group_size, tuple(rng_keys or ())


def _select_groups(experience: Experience, groups: list[int], group_size: int) -> Experience:
    """The samples of the given prompt groups (scored rollout, prompts, responses, masks)."""
    rows = [g * group_size + i for g in groups for i in range(group_size)]
    index = torch.tensor(rows, device=experience.valid.device)
    in_loss = experience.in_loss if experience.in_loss is not None else experience.valid
    return Experience(experience.rollout.select(index), [experience.prompts[r] for r in rows],
                      [experience.responses[r] for r in rows], experience.valid[index], in_loss[index])


def _join(parts: list[Experience], pad_token_id: int, stats: dict[str, float]) -> Experience:
    """Prompt groups from several generation rounds as one batch, in order."""
    rollout = concat_rollouts([part.rollout for part in parts], pad_token_id)
    return Experience(rollout, [p for part in parts for p in part.prompts],
                      [r for part in parts for r in part.responses], torch.cat([part.valid for part in parts]),
                      torch.cat([part.in_loss for part in parts]), stats)
