"""The exact task (rlhf_lab/testbed/): metrics against hand computation, the closed-form optimum, the tokenizer and
model (special tokens have zero probability, responses are exactly T symbols), the reward table, and the
config rules around it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import rlhf_lab.components  # noqa: F401
from rlhf_lab.errors import ConfigError, RewardError
from rlhf_lab.generation.hf import generate
from rlhf_lab.registry import get
from rlhf_lab.scoring.logprobs import gather_logprobs
from rlhf_lab.testbed.metrics import enumerate_logits, exact_metrics, regularised_optimum
from rlhf_lab.testbed.task import (
    PROMPT,
    SPECIAL_TOKENS,
    all_responses,
    build_model,
    build_tokenizer,
    reward_table,
    table_index,
    token_ids,
)

DIMS = SimpleNamespace(symbols=3, init_seed=0, init_std=0.2, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)


def test_metrics_match_a_two_symbol_two_token_case_by_hand() -> None:
    # π(x1) = (½, ½); π(x2 | a) = (0.8, 0.2), π(x2 | b) = (0.4, 0.6): π(aa, ab, ba, bb) = (0.4, 0.1, 0.2, 0.3).
    # π_ref is uniform per token (¼ per sequence); R = (1, 0, 0, 0.5); β = ½.
    logprobs = torch.tensor([[0.5, 0.8], [0.5, 0.2], [0.5, 0.4], [0.5, 0.6]]).log()
    ref_logprobs = torch.full((4, 2), 0.5).log()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    policy, beta = [0.4, 0.1, 0.2, 0.3], 0.5
    kl = sum(p * math.log(p / 0.25) for p in policy)
    reward = 0.4 * 1.0 + 0.3 * 0.5
    partition = 0.25 * (math.exp(2.0) + 1.0 + 1.0 + math.exp(1.0))  # Σ π_ref·exp(R/β)
    optimal = [0.25 * math.exp(r / beta) / partition for r in (1.0, 0.0, 0.0, 0.5)]
    estimates = (logprobs - ref_logprobs) ** 2 / 2  # k2 per token, for the estimate's bias
    expected_k2 = sum(p * float(e.sum()) for p, e in zip(policy, estimates))
    metrics = exact_metrics(logprobs, ref_logprobs, rewards, beta, estimates)
    expected = {
        "exact/kl_sequence": kl,
        "exact/reward": reward,
        "exact/objective": reward - beta * kl,
        "exact/optimal_objective": beta * math.log(partition),
        "exact/gap": beta * math.log(partition) - (reward - beta * kl),
        "exact/gap_initial": beta * math.log(partition) - 0.25 * (1.0 + 0.5),  # π_ref's: E_ref[R], no KL
        "exact/kl_optimal": sum(q * math.log(q / 0.25) for q in optimal),
        "exact/reward_optimal": sum(q * r for q, r in zip(optimal, (1.0, 0.0, 0.0, 0.5))),
        "exact/tv_to_optimal": 0.5 * sum(abs(p - q) for p, q in zip(policy, optimal)),
        "exact/kl_to_optimal": sum(p * math.log(p / q) for p, q in zip(policy, optimal)),
        "exact/total_probability": 1.0,
        "exact/kl_estimate_expected": expected_k2,
        "exact/kl_estimate_bias": expected_k2 - kl,
        "exact/entropy": -sum(p * math.log(p) for p in policy),
        "exact/entropy_optimal": -sum(q * math.log(q) for q in optimal),
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    # The gap is β·KL(π‖π*), and 0 at π*.
    assert metrics["exact/gap"] == pytest.approx(beta * sum(p * math.log(p / q) for p, q in zip(policy, optimal)))
    optimal_logprobs = torch.tensor(optimal, dtype=torch.float64).log()[:, None]  # π* as a one-token policy
    at_optimum = exact_metrics(optimal_logprobs, torch.full((4, 1), 0.25, dtype=torch.float64).log(), rewards, beta)
    assert at_optimum["exact/gap"] == pytest.approx(0.0, abs=1e-12)


def test_optimum_without_a_penalty_is_the_best_response() -> None:
    ref = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    log_optimal, objective = regularised_optimum(ref, torch.tensor([0.0, 1.0, 0.2, 1.0]), beta=0.0)
    assert objective == 1.0
    torch.testing.assert_close(log_optimal.exp(), torch.tensor([0.0, 1 / 3, 0.0, 2 / 3], dtype=torch.float64))


def test_tokenizer_and_model_put_all_mass_on_the_symbols() -> None:
    tokenizer = build_tokenizer(3)
    assert len(tokenizer) == len(SPECIAL_TOKENS) + 3 and tokenizer.eos_token_id is None
    assert tokenizer(PROMPT, add_special_tokens=False)["input_ids"] == [tokenizer.bos_token_id]
    assert tokenizer.decode(token_ids(torch.tensor([2, 0, 1])).tolist()) == "c a b"
    model = build_model(tokenizer, DIMS)
    responses = all_responses(3, 2)
    with torch.no_grad():
        logits = enumerate_logits(model, tokenizer, responses, temperature=1.0)
    probabilities = logits.softmax(-1)
    assert bool((probabilities[..., : len(SPECIAL_TOKENS)] == 0).all())
    sequence_probability = gather_logprobs(logits, token_ids(responses)).double().sum(-1).exp()
    assert float(sequence_probability.sum()) == pytest.approx(1.0, abs=1e-6)
    # Same task seed, same reference; the table index is the base-V number.
    torch.testing.assert_close(build_model(tokenizer, DIMS).lm_head.weight, model.lm_head.weight)
    assert table_index(responses, 3).tolist() == list(range(9))


def test_generation_gives_exactly_t_symbols_with_a_full_mask() -> None:
    tokenizer = build_tokenizer(3)
    model = build_model(tokenizer, DIMS)
    torch.manual_seed(0)
    rollout = generate(model, tokenizer, [PROMPT] * 4, group_size=8, max_new_tokens=3, temperature=1.0, top_p=1.0,
                       top_k=0, max_prompt_tokens=1, keep_logits=True)
    assert rollout.response_ids.shape == (32, 3)
    assert bool((rollout.response_mask == 1).all())
    assert bool((rollout.response_ids >= len(SPECIAL_TOKENS)).all())


def test_reward_table_structure_and_lookup() -> None:
    table = reward_table(3, 2, seed=5, peaks=2, peak_reward=1.0, noise=0.3)
    assert torch.equal(table, reward_table(3, 2, seed=5, peaks=2, peak_reward=1.0, noise=0.3))
    top = table.sort(descending=True).values
    assert 1.0 <= top[0] < 1.3 and 0.5 <= top[1] < 0.8 and bool((top[2:] < 0.3).all())
    reward = get("reward", "exact_table")({"symbols": 3, "length": 2, "seed": 5, "peaks": 2, "peak_reward": 1.0,
                                          "noise": 0.3})
    scores = reward([PROMPT] * 3, ["a a", "b c", "c c"]).scores
    torch.testing.assert_close(scores, table[[0, 5, 8]].float())
    with pytest.raises(RewardError, match="is not 2 symbols"):
        reward([PROMPT], ["a a a"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.top_p=0.9"], "top_p"),
    (["data=movie_prompts"], "data=exact"),
    (["trainer.max_new_tokens=9"], "responses, over"),
    (["reward.length=2"], "reward.length=2"),
    (["kl.importance_weight=true"], "kl.importance_weight=True acts on the loss-placed KL term"),
    (["kl=k3", "kl.clamp_log_ratio=0"], "kl.clamp_log_ratio=0.0 is out of range"),
    (["kl.off_policy_correction=ratio"], "kl.off_policy_correction='ratio' is not valid; did you mean 'token_ratio'\\? choose from: .*prefix_ratio"),
    (["kl.off_policy_correction=token_ratio"], "kl.off_policy_correction=token_ratio weighs the loss-placed KL"),
    (["kl=k3", "kl.off_policy_correction=prefix_ratio", "kl.importance_weight=true"], "would weigh it twice"),
    (["algorithm.tis_mode=off"], "algorithm.tis_mode='off' is not valid; choose from: .*, none"),
])
def test_config_rules(compose, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose(["experiment=exact", *overrides])


def test_defaults_and_zero_gradient_warning(compose, capsys: pytest.CaptureFixture[str]) -> None:
    from rlhf_lab.config import validate_kl

    assert compose(["kl=kl"]).kl.placement == "reward"  # k1's option defaults to the placement that is right
    assert compose(["kl=k3"]).kl.placement == "loss"
    validate_kl._WARNED.clear()
    capsys.readouterr()
    for _ in range(2):  # k1 in the loss: zero expected gradient; one line, once per process
        compose(["experiment=exact", "kl.placement=loss"])
    compose(["experiment=exact", "kl=full", "kl.placement=reward"])
    compose(["experiment=exact"])  # k1 in the reward: no warning
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("warning: kl=kl with kl.placement=loss") and "[('kl', 'loss')]" in lines[0]
    assert "[('full', 'reward')]" in lines[1]


def test_every_ablation_arm_composes_to_its_estimator_and_placement(compose) -> None:
    from omegaconf import OmegaConf

    from rlhf_lab.config.compose import CONF_DIR, _hydra_compose

    sweep = _hydra_compose(["experiment=kl_ablation_exact"], return_hydra_config=True).hydra.sweeper.params
    arms = str(sweep["+kl_arm"]).split(",")
    others = {"k3_loss_v32"}  # experiment=async_kl's arm (an off-policy correction of k3, not an estimator)
    assert sorted(arms) == sorted(path.stem for path in (CONF_DIR / "kl_arm").glob("*.yaml") if path.stem not in others)
    assert len(arms) == 15
    assert str(sweep["algorithm"]) == "grpo,rloo" and str(sweep["seed"]) == "0,1,2"
    for arm in arms:
        cfg = compose(["experiment=kl_ablation_exact", f"+kl_arm={arm}", "algorithm=rloo"])
        estimator, _, placement = arm.rpartition("_")
        expected = ("none", "loss") if arm == "none" else (estimator, placement)
        assert (cfg.kl.name, cfg.kl.placement) == expected, arm
        assert cfg.kl.coef == 0.2 and cfg.model.name == "exact" and OmegaConf.select(cfg, "reward.symbols") == 4



def test_chunked_log_probs_keep_the_task_s_special_token_mask() -> None:
    """The task's model masks its special tokens after the LM head, in its own ``forward``: the chunked log-probs
    (``trainer.chunked_logprobs``, the default on a GPU) take its whole logits, so the mask holds and the numbers
    are the unchunked ones."""
    from rlhf_lab.scoring.forward import plain_head, response_logits

    tokenizer = build_tokenizer(3)
    model = build_model(tokenizer, DIMS)
    assert plain_head(model) is None
    responses = token_ids(all_responses(3, 2))
    input_ids = torch.cat([torch.full((len(responses), 1), tokenizer.bos_token_id), responses], 1)
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        chunked, _ = response_logits(model, input_ids, mask, 1, 1.0, head_chunk=4)
        whole, _ = response_logits(model, input_ids, mask, 1, 1.0, head_chunk=0)
    assert isinstance(chunked, torch.Tensor)
    torch.testing.assert_close(chunked, whole)
    assert bool((chunked[..., : len(SPECIAL_TOKENS)] <= -1e8).all())
