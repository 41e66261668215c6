"""PPO (rlhf_lab/algorithms/ppo.py, critic.py): the math against hand computation, the guards, the trainer.

Trainer runs use ``model=tiny`` with one torch thread (much faster than two threads on a shared CPU).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import rlhf_lab.algorithms  # noqa: F401  (registers the algorithms)
from rlhf_lab.algorithms.base import LossContext, PolicyOutput
from rlhf_lab.algorithms.critic import SeparateCritic, ValueHead, policy_trunk
from rlhf_lab.algorithms.losses import ClipRange, clip_loss
from rlhf_lab.algorithms.ppo import PPO, clipped_value_loss, explained_variance, gae_advantages, shape_scores
from rlhf_lab.generation.rollout import Rollout, scores_to_token_rewards

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PPO_STATS = [
    "loss/value",
    "loss/policy",
    "loss/total",
    "value/explained_variance",
    "value/mean",
    "returns/mean",
    "policy/clipfrac",
    "value/clipfrac",
    "policy/approxkl",
    "policy/entropy",
    "ppo/skipped_minibatches",
]
# A 1-layer tiny model, 2 prompts × 2 samples, 4 new tokens, 2 mini-batches of 2: a step takes ~0.1 s.
TINY_RUN = [
    "model=tiny",
    "model.tiny.hidden_size=16",
    "model.tiny.intermediate_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "algorithm=ppo",
    "reward=length",
    "reward.min_words=2",
    "reward.max_words=3",
    "reward.slope_words=2",
    "algorithm.group_size=2",
    "algorithm.mini_batch_size=2",
    "trainer.prompts_per_step=2",
    "trainer.max_new_tokens=4",
    "trainer.steps=2",
    "trainer.eval_prompts=0",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
    "trainer.num_threads=1",
    "logger=none",
]

def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, low, high):
    """(per-token loss, 0/1 where either clip binds) of ``losses.clip_loss``."""
    result = clip_loss(logprobs, old_logprobs, advantages, mask, ClipRange(low, high))
    return result.per_token, sum(result.events.values(), torch.zeros_like(mask))



@pytest.fixture(autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _load_tokenizer_once(monkeypatch):
    """Trainers here share one tokenizer (parsing SmolLM2's tokenizer takes about a second each time)."""
    import rlhf_lab.training.loop

    monkeypatch.setattr(rlhf_lab.training.loop, "load_tokenizer", _cached_tokenizer)


_TOKENIZERS: dict = {}


def _cached_tokenizer(model_cfg):
    from rlhf_lab.models.loading import load_tokenizer

    key = (model_cfg.name, model_cfg.name_or_path)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(model_cfg)
    return _TOKENIZERS[key]


def compose(*overrides: str):
    """The config a user would get from ``rlhf-lab OVERRIDES`` (composed and validated)."""
    from rlhf_lab.config import compose as compose_config

    return compose_config(list(overrides))


def make_trainer(run_dir: Path, *overrides: str):
    from rlhf_lab.training.loop import Trainer

    return Trainer(compose(*TINY_RUN, *overrides), run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def ppo_config(**changes):
    cfg = compose("model=tiny", "algorithm=ppo").algorithm
    for key, value in changes.items():
        cfg[key] = value
    return cfg


def fake_rollout(scores, token_rewards, mask, values=None, logprobs=None) -> Rollout:
    """A rollout with only what PPO reads; prompt width 1, so hidden state t predicts response token t.

    ``token_rewards`` become the rollout's KL penalty: score-on-last-token − token_rewards.
    """
    mask = torch.as_tensor(mask, dtype=torch.float32)
    scores = torch.as_tensor(scores, dtype=torch.float32)
    batch, length = mask.shape
    response_ids = torch.ones(batch, length, dtype=torch.long)
    zeros = torch.zeros(batch, length)
    return Rollout(
        input_ids=torch.cat([torch.ones(batch, 1, dtype=torch.long), response_ids], dim=1),
        attention_mask=torch.cat([torch.ones(batch, 1), mask], dim=1).long(),
        response_mask=mask,
        prompt_width=1,
        group_size=1,
        logprobs=zeros if logprobs is None else torch.as_tensor(logprobs, dtype=torch.float32),
        entropy=zeros,
        scores=scores,
        kl_penalty=scores_to_token_rewards(scores, mask) - torch.as_tensor(token_rewards, dtype=torch.float32),
        values=None if values is None else torch.as_tensor(values, dtype=torch.float32),
    )


# ------------------------------------------------------------------------------------------------
# GAE, whitening, clipping, explained variance: hand computation
# ------------------------------------------------------------------------------------------------

# Row 0 has 3 valid tokens; row 1 ends after 2, and its padding (reward 5, value 7) must be ignored.
GAE_REWARDS = [[0.0, 0.5, 1.0], [0.3, -1.0, 5.0]]
GAE_VALUES = [[0.2, 0.4, 0.6], [0.5, -0.2, 7.0]]
GAE_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
# gamma = 0.9, lam = 0.8 (gamma·lam = 0.72); δ_t = r_t + 0.9·V_{t+1} − V_t, A_t = δ_t + 0.72·A_{t+1}:
# row 0: δ2 = 1 − 0.6 = 0.4;            A2 = 0.4
#        δ1 = 0.5 + 0.54 − 0.4 = 0.64;  A1 = 0.64 + 0.72·0.4 = 0.928
#        δ0 = 0 + 0.36 − 0.2 = 0.16;    A0 = 0.16 + 0.72·0.928 = 0.82816
# row 1: δ1 = −1 + 0 (ends: bootstrap 0) + 0.2 = −0.8;  A1 = −0.8
#        δ0 = 0.3 − 0.18 − 0.5 = −0.38;  A0 = −0.38 + 0.72·(−0.8) = −0.956
GAE_ADVANTAGES = [[0.82816, 0.928, 0.4], [-0.956, -0.8, 0.0]]
GAE_RETURNS = [[1.02816, 1.328, 1.0], [-0.456, -1.0, 0.0]]  # A + V on valid tokens


def test_gae_matches_hand_computation_with_padding() -> None:
    def as64(rows):
        return torch.tensor(rows, dtype=torch.float64)

    advantages, returns = gae_advantages(as64(GAE_REWARDS), as64(GAE_VALUES), as64(GAE_MASK), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, as64(GAE_ADVANTAGES), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, as64(GAE_RETURNS), rtol=0, atol=1e-12)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value() -> None:
    rewards, values, mask = (torch.tensor(x, dtype=torch.float64) for x in (GAE_REWARDS, GAE_VALUES, GAE_MASK))
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(returns, reward_to_go, rtol=0, atol=1e-12)
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask, rtol=0, atol=1e-12)


def test_prepare_shapes_scores_only_and_whitens_over_valid_tokens() -> None:
    """reward_clip/normalize_scores touch the score part only; advantages are whitened over valid tokens."""
    mask = torch.tensor(GAE_MASK)
    scores = torch.tensor([3.0, -0.5])
    kl_part = torch.tensor([[-0.1, -0.2, -0.3], [0.05, -0.4, 0.0]])
    token_rewards = kl_part + scores_to_token_rewards(scores, mask)
    hidden = torch.tensor([[[0.2], [0.4], [0.6]], [[0.5], [-0.2], [7.0]]])  # value head w = 1, b = 0: V = h

    algorithm = PPO(ppo_config(gamma=0.9, lam=0.8, reward_clip=1.0, whiten_advantages=True))
    algorithm.critic = ValueHead(1)
    with torch.no_grad():
        algorithm.critic.linear.weight.fill_(1.0)
    rollout = fake_rollout(scores, token_rewards, mask)
    rollout, stats = algorithm.prepare(rollout, lambda batch: PolicyOutput(batch.logprobs, None, hidden))

    clipped_rewards = kl_part + scores_to_token_rewards(torch.tensor([1.0, -0.5]), mask)  # 3.0 clipped to 1.0
    expected_advantages, expected_returns = gae_advantages(clipped_rewards, hidden[..., 0], mask, 0.9, 0.8)
    torch.testing.assert_close(rollout.values, hidden[..., 0] * mask)
    torch.testing.assert_close(rollout.returns, expected_returns)
    valid = expected_advantages[mask.bool()].numpy()
    whitened = (valid - valid.mean()) / valid.std(ddof=1)
    torch.testing.assert_close(rollout.advantages[mask.bool()], torch.tensor(whitened, dtype=torch.float32))
    assert rollout.advantages[1, 2] == 0.0  # padding stays 0 and does not enter the statistics
    assert stats["value/mean"] == pytest.approx(float(hidden[..., 0][mask.bool()].mean()))
    torch.testing.assert_close(rollout.token_rewards, clipped_rewards)  # built once, from the shaped score

    unwhitened = PPO(ppo_config(gamma=0.9, lam=0.8, whiten_advantages=False))
    unwhitened.critic = algorithm.critic
    rollout = fake_rollout(scores, token_rewards, mask)
    rollout, _ = unwhitened.prepare(rollout, lambda batch: PolicyOutput(batch.logprobs, None, hidden))
    torch.testing.assert_close(rollout.advantages, gae_advantages(token_rewards, hidden[..., 0], mask, 0.9, 0.8)[0])


def test_shape_scores_normalizes_then_clips() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0])
    whitened = (scores - scores.mean()) / scores.std()
    torch.testing.assert_close(shape_scores(scores, None, True), whitened, rtol=0, atol=1e-6)
    torch.testing.assert_close(shape_scores(scores, 1.0, True), whitened.clamp(-1, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(shape_scores(scores, 2.5, False), torch.tensor([1.0, 2.0, 2.5, 2.5]))
    assert torch.equal(shape_scores(scores, None, False), scores)


def test_value_clip_binds_only_when_the_clipped_error_is_larger() -> None:
    # old value 0, return 1, clip 0.2. Moved to 0.5 towards the return: the clipped prediction 0.2 has the
    # larger error, so the clip binds and gives no gradient. Moved to 0.1 (inside the clip range) or to −0.5
    # (away from the return, so the unclipped error is larger): it does not bind.
    values = torch.tensor([[0.5, 0.1, -0.5]], requires_grad=True)
    old_values, returns, mask = torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)
    loss, clipped = clipped_value_loss(values, old_values, returns, mask, clip_value=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 0.8**2, 0.5 * 0.9**2, 0.5 * 1.5**2]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.9, -1.5]]))  # d½(V−R)²/dV = V − R

    unclipped, never = clipped_value_loss(values.detach(), old_values, returns, mask, clip_value=None)
    torch.testing.assert_close(unclipped, 0.5 * (values.detach() - 1) ** 2)
    assert never.sum() == 0


def test_policy_clip_binds_only_when_the_ratio_leaves_the_range_in_the_advantage_direction() -> None:
    # ratio e^{0.5} ≈ 1.65 with A = +1: clipped to 1.2 (binds); ratio 1.1 with A = +1: inside (no bind);
    # ratio 1.65 with A = −1: the unclipped −A·ratio is larger (no bind).
    logprobs = torch.tensor([[0.5, math.log(1.1), 0.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clipped = clipped_policy_loss(logprobs, torch.zeros(1, 3), advantages, torch.ones(1, 3), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.1, math.exp(0.5)]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]


def test_explained_variance_matches_numpy() -> None:
    generator = torch.Generator().manual_seed(0)
    returns = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    values = returns + 0.5 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    returns_valid, values_valid = returns[mask.bool()].numpy(), values[mask.bool()].numpy()
    expected = 1 - np.var(returns_valid - values_valid) / np.var(returns_valid)
    assert float(explained_variance(values, returns, mask)) == pytest.approx(expected, abs=1e-12)
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(explained_variance(values, torch.ones(3, 5, dtype=torch.float64), mask)) == 0.0  # Var(R) = 0


# ------------------------------------------------------------------------------------------------
# Guards: ratio threshold and target_kl
# ------------------------------------------------------------------------------------------------


def _loss_stats(algorithm: PPO, batch: Rollout, new_logprobs: torch.Tensor, context: LossContext) -> dict[str, float]:
    """The loss result's statistics, and its veto margin under ``veto`` (absent when there is none)."""
    hidden = torch.zeros(*batch.response_mask.shape, 1)
    result = algorithm.loss(batch, PolicyOutput(new_logprobs, None, hidden), context)
    stats = {key: float(value) for key, value in result.stats.items()}
    if result.veto is not None:
        stats["veto"] = float(result.veto)
    return stats


def _ratio_batch(rows: int, length: int) -> Rollout:
    """Old log-probs, values, returns 0, advantages 1: the new log-probs alone set the ratio."""
    mask = torch.ones(rows, length)
    rollout = fake_rollout(torch.zeros(rows), torch.zeros_like(mask), mask, values=torch.zeros_like(mask))
    return replace(rollout, returns=torch.zeros_like(mask), advantages=torch.ones_like(mask))


def test_ratio_threshold_vetoes_by_the_minibatch_mean_ratio_across_micro_batches() -> None:
    algorithm = PPO(ppo_config(ratio_threshold=10.0))
    algorithm.critic = ValueHead(1)

    def minibatch_margin(ratios, split):
        """Σ of the micro-batches' veto margins (what the updater compares with 0)."""
        new_logprobs = torch.tensor(ratios).log()
        batch = _ratio_batch(*new_logprobs.shape)
        context = LossContext(float(batch.response_mask.sum()), batch.batch_size)
        return sum(
            _loss_stats(algorithm, batch.select(torch.tensor(rows)), new_logprobs[rows], context)["veto"]
            for rows in split
        )

    assert minibatch_margin([[20.0, 20.0], [20.0, 20.0]], [[0, 1]]) == pytest.approx(20.0 - 10.0)
    assert minibatch_margin([[1.0, 1.0], [1.0, 1.0]], [[0, 1]]) == pytest.approx(1.0 - 10.0)
    # One token at ratio 25 among three at 1: mean 7 < 10, so no veto, although micro-batch 0 alone is at 13.
    mixed = [[25.0, 1.0], [1.0, 1.0]]
    assert minibatch_margin(mixed, [[0], [1]]) == pytest.approx(7.0 - 10.0)
    assert minibatch_margin(mixed, [[0, 1]]) == pytest.approx(7.0 - 10.0)

    no_guard = PPO(ppo_config(ratio_threshold=None))
    no_guard.critic = ValueHead(1)
    stats = _loss_stats(no_guard, _ratio_batch(2, 2), torch.full((2, 2), math.log(20.0)), LossContext(4.0, 2))
    assert "veto" not in stats
    assert stats["policy/ratio_mean"] == pytest.approx(20.0)


def test_target_kl_stops_epochs_only_above_the_target() -> None:
    assert PPO(ppo_config(target_kl=0.1)).should_stop_epochs({"policy/approxkl": 0.2})
    assert not PPO(ppo_config(target_kl=0.1)).should_stop_epochs({"policy/approxkl": 0.05})
    assert not PPO(ppo_config(target_kl=None)).should_stop_epochs({"policy/approxkl": 100.0})


def test_summarize_counts_vetoed_minibatches() -> None:
    assert PPO(ppo_config()).summarize({"optim/vetoed": 0.75}, 4) == {"ppo/skipped_minibatches": 3}
    assert PPO(ppo_config()).summarize({}, 4) == {"ppo/skipped_minibatches": 0}


def test_config_defaults_and_group_size_one() -> None:
    cfg = compose("algorithm=ppo").algorithm
    assert (cfg.name, cfg.critic, cfg.whiten_advantages) == ("ppo", "shared", True)
    assert (cfg.clip_eps, cfg.clip_value, cfg.vf_coef, cfg.gamma, cfg.lam) == (0.2, 0.2, 0.1, 1.0, 1.0)
    assert (cfg.target_kl, cfg.ratio_threshold) == (None, 10.0)
    assert (2 * cfg.group_size) % cfg.mini_batch_size == 0  # divides the default samples per step
    compose("algorithm=ppo", "algorithm.group_size=1", "algorithm.mini_batch_size=0")  # no groups needed
    from rlhf_lab.errors import UserError

    with pytest.raises(UserError, match="algorithm.clip_value"):
        compose("algorithm=ppo", "algorithm.clip_value=0")


# ------------------------------------------------------------------------------------------------
# Trainer level
# ------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_ratio_threshold_skips_are_counted_and_change_nothing(tmp_path: Path) -> None:
    # ratio_threshold 0.5 < 1: every mini-batch is vetoed (2 epochs × 2 mini-batches); parameters stay put.
    trainer = make_trainer(tmp_path / "veto", "algorithm.ratio_threshold=0.5", "algorithm.epochs=2")
    before = [p.detach().clone() for p in trainer.updater.parameters]
    metrics = trainer.train_step(0)
    assert metrics["ppo/skipped_minibatches"] == 4
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.updater.parameters))

    trainer = make_trainer(tmp_path / "pass", "algorithm.epochs=2")
    assert trainer.train_step(0)["ppo/skipped_minibatches"] == 0


def test_target_kl_stops_the_epoch_loop(tmp_path: Path) -> None:
    # A large learning rate moves the policy after the first mini-batch, so epoch 1's approx KL > 1e-9.
    # The entropy bonus makes that gradient non-zero even when the tiny run's rewards tie (with lam=1 and a
    # zero critic, tied rewards whiten to all-zero advantages and only the value head would move).
    common = ("algorithm.epochs=3", "trainer.lr=1e-2", "algorithm.entropy_coef=0.1")
    stopped = make_trainer(tmp_path / "stop", *common, "algorithm.target_kl=1e-9").train_step(0)
    full = make_trainer(tmp_path / "full", *common).train_step(0)
    assert stopped["optim/updates"] == 2  # one epoch of 2 mini-batches
    assert full["optim/updates"] == 6


@pytest.mark.parametrize(
    ("critic", "lora"), [("shared", "false"), ("separate", "false"), ("separate", "true")],
    ids=["shared", "separate", "separate_lora"],
)
def test_resume_reproduces_the_next_step_exactly(tmp_path: Path, critic: str, lora: str) -> None:
    """Policy (or adapter), critic, optimizer, scheduler and RNG restored: step 2 repeats to the last bit."""
    common = ("trainer.steps=3", "trainer.checkpoint_every=1", "trainer.keep_last_n=5", "trainer.lr=1e-3",
              f"algorithm.critic={critic}", f"model.lora.enabled={lora}", "model.lora.r=4",
              "trainer.micro_batch_size=1")
    uninterrupted = tmp_path / "uninterrupted"
    make_trainer(uninterrupted, *common).train()
    checkpoint = uninterrupted / "checkpoints" / "step_2"  # after 2 updates: resumes at step 2
    assert (checkpoint / f"{'value_head' if critic == 'shared' else 'critic'}.safetensors").is_file()

    resumed = tmp_path / "resumed"
    trainer = make_trainer(resumed, *common, f"trainer.resume={checkpoint}")
    assert trainer.start_step == 2
    trainer.train()
    expected = read_metrics(uninterrupted)[2]
    got = read_metrics(resumed)[0]
    assert got["step"] == expected["step"] == 2
    for key in ("loss/value", "loss/policy", "loss/total", "value/mean", "reward/mean"):
        assert got[key] == expected[key], key


@pytest.mark.parametrize("placement", ["reward", "loss"])
@pytest.mark.parametrize("estimator", ["kl", "abs", "mse", "k3", "full", "none"])
def test_end_to_end_every_kl_estimator_and_placement(tmp_path: Path, estimator: str, placement: str) -> None:
    make_trainer(tmp_path, f"kl={estimator}", f"kl.placement={placement}").train()
    _check_ppo_metrics(tmp_path)


@pytest.mark.parametrize("extra", [["algorithm.critic=separate"], ["model.lora.enabled=true", "model.lora.r=4"]],
                         ids=["separate_critic", "lora"])
def test_end_to_end_separate_critic_and_lora(tmp_path: Path, extra: list[str]) -> None:
    trainer = make_trainer(tmp_path, "kl=kl", "kl.placement=reward", *extra)
    head = trainer.algorithm.critic if "lora" in extra[0] else trainer.algorithm.critic.value_head
    head_before = head.linear.weight.detach().clone()
    trainer.train()
    _check_ppo_metrics(tmp_path)
    assert not torch.equal(head.linear.weight, head_before)  # the value head trained
    assert all(p.dtype == torch.float32 for p in head.parameters())


def _check_ppo_metrics(run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        for key in PPO_STATS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row.get(key))


def test_separate_critic_with_lora_shares_frozen_weights_and_saves_only_its_own(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, "algorithm.critic=separate", "model.lora.enabled=true", "model.lora.r=4")
    critic = trainer.algorithm.critic
    assert isinstance(critic, SeparateCritic)
    policy_weight = policy_trunk(trainer.policy).layers[0].self_attn.q_proj.base_layer.weight
    assert critic.trunk.layers[0].self_attn.q_proj.base_layer.weight is policy_weight  # shared, frozen
    critic_lora = critic.trunk.layers[0].self_attn.q_proj.lora_A["default"].weight
    policy_lora = policy_trunk(trainer.policy).layers[0].self_attn.q_proj.lora_A["default"].weight
    assert critic_lora is not policy_lora and critic_lora.requires_grad
    saved = critic.state_dict()
    assert set(saved) == {name for name, p in critic.named_parameters() if p.requires_grad}
    assert "value_head.linear.weight" in saved and not any("base_layer" in name for name in saved)
    critic.load_state_dict(saved)  # round trip with the frozen weights absent
