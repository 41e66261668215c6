"""update: parameter groups, the optimizer step's guards, vetoes, and micro-batch accumulation (Updater)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import rlhf_lab.components  # noqa: F401
from rlhf_lab.algorithms.base import Algorithm, LossResult, PolicyOutput, token_mean
from rlhf_lab.algorithms.critic import ValueHead
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.hardware.allocator import preallocate_adam_state
from rlhf_lab.registry import get
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.step.update import Updater, lr_lambda, parameter_groups

TRAINER = {"lr": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.999, "weight_decay": 0.0, "lr_schedule": "constant",
           "warmup_steps": 0, "steps": 10, "max_grad_norm": None, "micro_batch_size": 0, "max_new_tokens": 3,
           "temperature": 1.0, "recompute": None, "gradient_checkpointing": False}


def config(**algorithm):
    return OmegaConf.create({"seed": 0, "trainer": TRAINER, "algorithm": {"epochs": 1, "mini_batch_size": 0,
                                                                          **algorithm}})


class Toy(Algorithm):
    """Loss = token mean of −w·A over the micro-batch; an optional veto margin per micro-batch."""

    def __init__(self, veto: float | None = None) -> None:
        self.veto = veto

    def loss(self, batch, output, context):
        per_token = -output.logprobs * batch.advantages
        veto = None if self.veto is None else torch.tensor(self.veto * batch.batch_size)
        loss = token_mean(per_token, batch.response_mask, context)
        return LossResult(loss, {"loss/policy": loss.detach()}, veto)


def toy_updater(algorithm: Algorithm, hardware: HardwareProfile | None = None, **trainer) -> tuple[Updater, nn.Linear]:
    policy = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        policy.weight.fill_(1.0)
    cfg = config()
    cfg.trainer.update(trainer)
    updater = Updater(cfg, policy, algorithm, None, torch.device("cpu"), hardware=hardware)
    # The policy's "log-prob" of every token is its single weight w.
    updater.forward = lambda batch: PolicyOutput(policy.weight[0, 0] * batch.response_mask, batch.response_mask,
                                                 None)
    return updater, policy


def toy_rollout(rows: int = 4, mask_rows: list[list[float]] | None = None) -> Rollout:
    mask = torch.tensor(mask_rows) if mask_rows else torch.ones(rows, 3)
    rows = mask.shape[0]
    return Rollout(input_ids=torch.zeros(rows, 4, dtype=torch.long), attention_mask=torch.ones(rows, 4),
                   response_mask=mask, prompt_width=1, group_size=1, logprobs=torch.zeros(rows, 3),
                   entropy=torch.zeros(rows, 3), advantages=torch.ones(rows, 3) * mask)


def test_parameter_groups_put_each_tensor_once_and_the_critic_at_its_own_rate() -> None:
    policy = nn.Linear(2, 2)
    ppo = get("algorithm", "ppo")(OmegaConf.create({"critic": "shared", "critic_lr": 1e-3, "clip_eps": 0.2,
                                                    "clip_eps_low": None, "clip_eps_high": None}))
    ppo.critic = ValueHead(2)
    groups = parameter_groups(policy, ppo, lr=1e-5)
    assert [group["lr"] for group in groups] == [1e-5, 1e-3]
    assert [len(group["params"]) for group in groups] == [2, 2]
    # A module that shares the policy's tensors adds nothing new: no empty group.
    ppo.critic = policy
    assert [group["lr"] for group in parameter_groups(policy, ppo, lr=1e-5)] == [1e-5]


def test_lr_lambda_warmup_then_schedule() -> None:
    factor = lr_lambda("linear", warmup_steps=2, total_steps=6)
    assert [factor(step) for step in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = lr_lambda("cosine", 0, 4)
    assert cosine(2) == pytest.approx(0.5)
    assert lr_lambda("constant", 0, 4)(3) == 1.0


def test_an_update_moves_the_weight_by_adams_first_step() -> None:
    updater, policy = toy_updater(Toy())
    metrics = updater.update(toy_rollout(), coef=0.0, step=0, timer=StepTimer())
    # Loss −w, gradient −1; Adam's first step moves w by lr = 0.1 against the gradient.
    assert policy.weight.item() == pytest.approx(1.1, abs=1e-6)
    assert metrics["optim/updates"] == 1
    assert metrics["optim/skipped"] == 0.0
    assert metrics["loss/policy"] == pytest.approx(-1.0)
    assert "optim/vetoed" not in metrics
    assert policy.weight.grad is None  # applied gradients are freed at once, not kept until the next update


def test_a_veto_drops_the_minibatch_without_counting_a_skip() -> None:
    updater, policy = toy_updater(Toy(veto=0.5))
    metrics = updater.update(toy_rollout(), coef=0.0, step=0, timer=StepTimer())
    assert policy.weight.item() == 1.0
    assert metrics["optim/vetoed"] == 1.0
    assert metrics["optim/skipped"] == 0.0
    assert updater.skipped_updates == 0
    # A negative margin summed over the micro-batches is no veto.
    updater, policy = toy_updater(Toy(veto=-0.5), micro_batch_size=2)
    assert updater.update(toy_rollout(), 0.0, 0, StepTimer())["optim/vetoed"] == 0.0
    assert policy.weight.item() != 1.0


def test_a_nonfinite_gradient_skips_the_step_and_counts_it() -> None:
    updater, policy = toy_updater(Toy())
    policy.weight.register_hook(lambda grad: grad * float("inf"))
    metrics = updater.update(toy_rollout(), coef=0.0, step=0, timer=StepTimer())
    assert policy.weight.item() == 1.0
    assert metrics["optim/skipped"] == 1.0
    assert (updater.skipped_updates, updater.consecutive_skips) == (1, 1)
    assert updater.state_dict() == {"skipped_updates": 1, "consecutive_skips": 1}


def test_micro_batches_accumulate_to_the_whole_minibatch() -> None:
    ragged = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    whole, whole_policy = toy_updater(Toy())
    micro, micro_policy = toy_updater(Toy(), micro_batch_size=1)
    whole_metrics = whole.update(toy_rollout(mask_rows=ragged), 0.0, 0, StepTimer())
    micro_metrics = micro.update(toy_rollout(mask_rows=ragged), 0.0, 0, StepTimer())
    assert micro_policy.weight.item() == pytest.approx(whole_policy.weight.item(), abs=1e-7)
    assert micro_metrics["loss/policy"] == pytest.approx(whole_metrics["loss/policy"])


def test_epochs_and_minibatches_count_updates() -> None:
    updater, _ = toy_updater(Toy())
    updater.cfg.algorithm.epochs = 3
    updater.cfg.algorithm.mini_batch_size = 2
    assert updater.update(toy_rollout(), 0.0, 0, StepTimer())["optim/updates"] == 6


@pytest.mark.parametrize("fused", [True, False])
def test_adams_state_made_before_the_first_step_updates_as_the_lazily_made_one(fused: bool) -> None:
    torch.manual_seed(0)
    lazy_model = nn.Linear(4, 3)
    early_model = nn.Linear(4, 3)
    early_model.load_state_dict(lazy_model.state_dict())
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=0.1, weight_decay=0.01, fused=fused)
    early = torch.optim.AdamW(early_model.parameters(), lr=0.1, weight_decay=0.01, fused=fused)
    preallocate_adam_state(early)
    for p in early_model.parameters():
        state = early.state[p]
        assert float(state["step"]) == 0.0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    inputs = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, optimizer in ((lazy_model, lazy), (early_model, early)):
            model(inputs).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for p, q in zip(lazy_model.parameters(), early_model.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(lazy.state[p][key], early.state[q][key])
            assert lazy.state[p][key].dtype == early.state[q][key].dtype


def test_the_cpu_profile_makes_adams_state_up_front_and_the_plain_path_lazily() -> None:
    updater, policy = toy_updater(Toy(), hardware=HardwareProfile(preallocate_optimizer=True))
    assert float(updater.optimizer.state[policy.weight]["step"]) == 0.0
    updater, policy = toy_updater(Toy())
    assert policy.weight not in updater.optimizer.state
