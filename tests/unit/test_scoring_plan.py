"""The scoring plan: where π_old, the entropy and PPO's values come from, decided once from the config, the engine's
capabilities (never its name) and the precision; each case against the rule in rlhf_lab/step/scoring_pass.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rlhf_lab.runtime.precision import Precision
from rlhf_lab.step.scoring_pass import BatchScoring, ScoringPlan


class TrainerNumbers:  # an engine whose log-probs are the training model's own pass (as the hf engine's)
    trainer_logprobs = True


class OwnNumbers:  # an engine with numbers of its own that reports entropies and logits
    pass


class TokensOnly:  # an engine that reports only the sampled tokens' log-probs (as vLLM)
    reports_entropy = False


def cfg(epochs: int = 1, logprobs: str = "auto", tis_cap: float | None = None, staleness: int = 0) -> object:
    return OmegaConf.create({
        "algorithm": {"epochs": epochs, "mini_batch_size": 0, "group_size": 2, "tis_cap": tis_cap},
        "trainer": {"prompts_per_step": 2},
        "generation": {"name": "anything", "logprobs": logprobs, "max_staleness": staleness},
    })


def plan(config: object, engine: type, precision: str = "fp32", reads_logits: bool = False,
         keep_hidden: bool = False, episodes: bool = False) -> ScoringPlan:
    return ScoringPlan.from_config(config, engine, Precision(precision, "cpu"), SimpleNamespace(reads_logits=reads_logits),
                                   keep_hidden, episodes)


@pytest.mark.parametrize(("engine", "precision", "epochs", "rescore", "old_from_update"), [
    (TrainerNumbers, "fp32", 1, False, False),  # the sampler's numbers are the trainer's
    (TrainerNumbers, "fp32", 2, False, False),
    (TrainerNumbers, "bf16-mixed", 1, False, True),  # another rounding, one update: the training pass's are π_old
    (TrainerNumbers, "bf16-mixed", 2, True, False),  # another rounding, several updates: a scoring pass
    (OwnNumbers, "fp32", 1, False, True),
    (OwnNumbers, "fp32", 2, True, False),
])
def test_the_plan_follows_the_engines_numbers_the_precision_and_the_updates(engine, precision, epochs, rescore,
                                                                             old_from_update) -> None:
    chosen = plan(cfg(epochs), engine, precision)
    assert (chosen.rescore, chosen.old_from_update) == (rescore, old_from_update)


@pytest.mark.parametrize(("config", "episodes", "rescore"), [
    (cfg(2, logprobs="sampler"), False, False),  # sampler: never
    (cfg(1, logprobs="trainer"), False, True),  # trainer: always
    (cfg(1, tis_cap=2.0), False, True),  # the correction needs the trainer's numbers
    (cfg(1, staleness=1), False, True),  # the sampler is a past policy
    (cfg(1), True, True),  # multi-turn episodes
])
def test_the_config_can_ask_for_the_scoring_pass_or_refuse_it(config, episodes, rescore) -> None:
    assert plan(config, OwnNumbers, episodes=episodes).rescore is rescore


def test_an_engine_is_known_by_its_attributes_never_its_name() -> None:
    named_hf = type("HFGeneration", (), {})  # the hf engine's class name, without its capability
    assert plan(cfg(2), named_hf).rescore
    assert not plan(cfg(2), type("Anything", (), {"trainer_logprobs": True})).rescore


def test_a_tokens_only_engine_is_rescored_where_a_batch_reads_what_it_does_not_report() -> None:
    single = plan(cfg(1), TokensOnly)
    assert not single.rescore and single.old_from_update
    # a training batch with one update and no logits read: the training pass gives π_old and the entropy
    assert single.for_batch(exact=False, train=True) == BatchScoring(False, True, True)
    assert single.for_batch(exact=True, train=True) == BatchScoring(True, False, False)  # the exact KL
    assert single.for_batch(exact=False, train=False) == BatchScoring(True, False, False)  # an evaluation
    assert plan(cfg(1), TokensOnly, reads_logits=True).for_batch(False, True).rescore  # a full-logits estimator
    assert plan(cfg(1), TokensOnly, keep_hidden=True).for_batch(False, True).rescore  # PPO's critic
    assert plan(cfg(2), TokensOnly).for_batch(False, True) == BatchScoring(True, False, False)


def test_an_engine_that_reports_logits_needs_no_pass_for_them() -> None:
    chosen = plan(cfg(1), TrainerNumbers)
    assert chosen.for_batch(exact=True, train=True) == BatchScoring(False, False, False)
    assert chosen.for_batch(exact=False, train=False) == BatchScoring(False, False, False)
