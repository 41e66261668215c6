"""The exact task through the real trainer: an unbiased configuration reaches the regularised optimum, a biased
one stays at its own fixed point (computed by enumeration), the exact metrics are logged (LoRA and resume too),
and the report ranks arms by final gap."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_lab.registry import get
from rlhf_lab.testbed.metrics import ExactEvaluator, exact_metrics
from rlhf_lab.testbed.task import SPECIAL_TOKENS
from rlhf_lab.tools.report import build_report
from rlhf_lab.training.loop import Trainer

# V = 3 symbols, T = 2 (9 responses), 2 reward peaks, β = 0.2; RLOO (exact baseline), 32 samples per step.
TINY_TASK = ["experiment=exact", "model.exact.symbols=3", "trainer.max_new_tokens=2", "reward.peaks=2",
             "kl.coef=0.2", "algorithm=rloo", "trainer.lr=3e-3", "trainer.steps=150", "trainer.exact_every=0",
             "logger.samples_every=1000", "seed=1"]
UNBIASED_GAP = 0.005  # k1 in the reward ends within this of J* (measured: 0.0003, 0.0002 for seeds 1, 2)


def train(compose, overrides: list[str], folder: Path) -> Trainer:
    trainer = Trainer(compose([*overrides, f"trainer.output_dir={folder}"]), folder)
    trainer.train()
    return trainer


def fixed_point_of_k3_in_the_loss(ref_logits: torch.Tensor, responses: torch.Tensor, rewards: torch.Tensor,
                                  beta: float) -> torch.Tensor:
    """The stationary policy of E[∇(−R·log π(y) + β·Σ_t k3_t(y))] for a tabular two-step policy: the exact
    expected update of RLOO with k3 in the loss (the loss's per-token mean has the policy loss's 1/T)."""
    symbols = ref_logits[..., len(SPECIAL_TOKENS):].double().log_softmax(-1)  # [N, T, V]
    ref1 = symbols[0, 0]
    ref2 = torch.stack([symbols[int((responses[:, 0] == a).nonzero()[0]), 1] for a in range(symbols.shape[-1])])
    first, second = responses[:, 0], responses[:, 1]
    ref_logprobs = torch.stack([ref1[first], ref2[first, second]], 1)
    z1, z2 = ref1.clone().requires_grad_(), ref2.clone().requires_grad_()
    optimizer = torch.optim.Adam([z1, z2], lr=0.05)
    for _ in range(3000):
        logprobs = torch.stack([z1.log_softmax(-1)[first], z2.log_softmax(-1)[first, second]], 1)
        weights = logprobs.sum(-1).exp().detach()
        k3 = get("kl", "k3")(logprobs, ref_logprobs)
        surrogate = (weights * (-rewards.double() * logprobs.sum(-1) + beta * k3.sum(-1))).sum()
        optimizer.zero_grad()
        surrogate.backward()
        optimizer.step()
    assert float(torch.cat([z1.grad.reshape(-1), z2.grad.reshape(-1)]).norm()) < 1e-8  # stationary
    return logprobs.detach()


def test_unbiased_run_reaches_the_optimum_and_k3_in_the_loss_its_own_fixed_point(compose, tmp_path: Path) -> None:
    unbiased = train(compose, [*TINY_TASK, "kl=kl", "kl.placement=reward"], tmp_path / "k1_reward")
    last = json.loads((tmp_path / "k1_reward" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 149 and last["exact/gap"] < UNBIASED_GAP and last["exact/tv_to_optimal"] < 0.03
    assert abs(last["exact/kl_sequence"] - last["exact/kl_optimal"]) < 0.1
    assert abs(last["exact/kl_estimate_bias"]) < 1e-5  # k1 is unbiased in value

    biased = train(compose, [*TINY_TASK, "kl=k3", "kl.placement=loss"], tmp_path / "k3_loss")
    evaluator = ExactEvaluator(biased)
    _, final_logprobs = evaluator.policy()
    fixed_point = fixed_point_of_k3_in_the_loss(evaluator.ref_logits, evaluator.sequences, evaluator.rewards, 0.2)
    at_fixed_point = exact_metrics(fixed_point, evaluator.ref_logprobs, evaluator.rewards, 0.2)
    final = exact_metrics(final_logprobs, evaluator.ref_logprobs, evaluator.rewards, 0.2)
    tv_to_fixed_point = 0.5 * float((final_logprobs.double().sum(-1).exp() - fixed_point.sum(-1).exp()).abs().sum())
    # The fixed point is provably away from π* (gap 0.050, TV 0.16), and the run ends nearer to it than to π*
    # (measured, seeds 1 and 2: gap 0.044, 0.034; TV to the fixed point 0.026, 0.076, to π* 0.149, 0.130).
    assert at_fixed_point["exact/gap"] > 6 * UNBIASED_GAP and at_fixed_point["exact/tv_to_optimal"] > 0.1
    assert final["exact/gap"] > 4 * UNBIASED_GAP
    assert tv_to_fixed_point < final["exact/tv_to_optimal"]
    assert unbiased.step == biased.step == 149


def test_exact_metrics_are_logged_with_lora_and_resume(compose, tmp_path: Path) -> None:
    overrides = ["experiment=exact", "trainer.steps=4", "trainer.exact_every=2", "trainer.checkpoint_every=2",
                 "model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]
    folder = tmp_path / "run"
    train(compose, [*overrides, "trainer.steps=2"], folder)
    train(compose, [*overrides, "trainer.resume=auto"], folder)
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    exact_steps = [line["step"] for line in lines if "exact/gap" in line]
    assert exact_steps == [1, 3]
    for line in lines:
        if "exact/gap" in line:
            assert line["exact/total_probability"] == pytest.approx(1.0, abs=1e-5)
            assert line["exact/gap"] > 0 and line["exact/kl_sequence"] > 0
            assert line["exact/optimal_objective"] == pytest.approx(lines[1]["exact/optimal_objective"])


def test_report_ranks_arms_by_final_gap(tmp_path: Path) -> None:
    gaps = {"kl_reward": 0.001, "k3_loss": 0.05, "mse_loss": 0.02}
    for (arm, gap), seed in itertools.product(gaps.items(), (0, 1)):
        folder = tmp_path / f"{arm}_{seed}"
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "trainer": {"steps": 2}}))
        (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {
            "kl_arm": arm}}}}))
        lines = [{"step": step, "reward/mean": 0.5, "kl/estimate": 0.1, "kl/exact": 0.1, "time/step_s": 0.01,
                  "exact/gap": gap * (2 - step) + seed * 1e-4, "exact/kl_sequence": 1.0, "exact/kl_optimal": 1.2,
                  "exact/tv_to_optimal": 0.1, "exact/kl_estimate_bias": 0.0} for step in (0, 1)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    table, rows = build_report(tmp_path)
    assert [row["arm"] for row in rows] == ["kl_arm=kl_reward", "kl_arm=mse_loss", "kl_arm=k3_loss"]
    assert rows[0]["final_gap_mean"] == pytest.approx(0.001 + 0.5e-4) and "final gap J*−J" in table
    assert (tmp_path / "gap_vs_step.png").is_file() and (tmp_path / "kl_sequence_vs_step.png").is_file()


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "reinforce"])
def test_loss_options_run_with_off_policy_mini_batches(compose, tmp_path: Path, algorithm: str) -> None:
    overrides = ["experiment=exact", f"algorithm={algorithm}", "trainer.steps=2", "algorithm.mini_batch_size=8",
                 "algorithm.epochs=2", "kl=sequence_full", "kl.importance_weight=true", "kl.clamp_log_ratio=20",
                 "kl.clamp_value=10", "algorithm.loss_aggregation=sequence_mean"]
    train(compose, overrides, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        assert line["optim/updates"] == 8 and line["optim/skipped"] == 0.0
        assert line["loss/kl"] == line["loss/kl"] and line["loss/kl"] != 0.0  # finite, and acting
        assert line["exact/total_probability"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow  # two 150-step runs on the exact task: about 16 s
def test_grpo_s_loss_placed_kl_scaled_like_the_advantages_closes_most_of_the_gap(compose, tmp_path: Path) -> None:
    """GRPO with k2 in the loss drifts towards the reward maximiser (its std division scales the task reward, not
    the KL); ``kl.loss_scale=advantage`` gives the KL the advantages' factor and ends far nearer J* (measured at
    150 steps: gap 0.124 → 0.076, where RLOO, whose factor is 1, ends at 0.053, k2's own per-position bias).
    Under RLOO the option changes nothing: the same run bit for bit."""
    gaps = {}
    for scale in ("none", "advantage"):
        folder = tmp_path / scale
        train(compose, ["experiment=exact", "algorithm=grpo", "kl=mse", "kl.placement=loss", f"kl.loss_scale={scale}",
                        "trainer.steps=150", "trainer.lr=3e-3", "trainer.exact_every=0", "logger.samples_every=1000"],
              folder)
        gaps[scale] = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["exact/gap"]
    assert gaps["none"] > 0.1 and gaps["advantage"] < 0.75 * gaps["none"], gaps

    runs = []
    for scale in ("none", "advantage"):
        folder = tmp_path / f"rloo_{scale}"
        train(compose, [*TINY_TASK, "trainer.steps=3", "kl=mse", "kl.placement=loss", f"kl.loss_scale={scale}"],
              folder)
        runs.append([{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/", "perf/"))}
                     for line in (folder / "metrics.jsonl").read_text().splitlines()])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(("experiment", "swept"), [
    ("kl_placement_bias", {"+kl_arm": "kl_reward,kl_loss,mse_reward,mse_loss,k3_reward,k3_loss,abs_reward,abs_loss,"
                                      "full_reward,full_loss,none",
                          "seed": "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19"}),
    ("kl_to_go", {"+kl_arm": "kl_reward,mse_loss,k1_plus_loss,full_loss,sequence_k1_loss,sequence_full_loss",
                  "seed": "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19"}),
    ("grpo_kl_scale", {"+kl_arm": "mse_loss,k3_loss,sequence_k1_loss", "algorithm": "grpo,rloo",
                       "kl.loss_scale": "none,advantage", "seed": "0,1,2,3,4,5,6,7,8,9"}),
])
def test_every_literature_job_composes_on_the_exact_task(compose, experiment: str, swept: dict) -> None:
    """Each paper's experiment sweeps what its docs page says (≥ 3 seeds), and every one of its jobs is a valid
    config on the exact task (a job refused at start would be a hole in the table)."""
    import itertools

    from rlhf_lab.config.compose import _hydra_compose

    sweep = _hydra_compose([f"experiment={experiment}"], return_hydra_config=True).hydra.sweeper.params
    assert {key: str(value) for key, value in sweep.items()} == swept
    options = {key: value.split(",") for key, value in swept.items() if key != "seed"}  # a seed never refuses
    for values in itertools.product(*options.values()):
        cfg = compose([f"experiment={experiment}", *(f"{key}={value}" for key, value in zip(options, values))])
        assert cfg.model.name == "exact" and cfg.kl.coef == 0.2 and cfg.trainer.steps == 400


def test_with_a_stop_symbol_an_unbiased_run_still_reaches_the_optimum(compose, tmp_path: Path) -> None:
    """``model.exact.stop``: responses of 2 or 3 tokens (the third symbol ends one) over the same task. k1 in the
    reward still ends at π* (what the enumeration of variable-length responses computes is what the engine samples
    and the reward scores), the enumeration's mass is whole, and the sampled lengths vary."""
    train(compose, [*TINY_TASK, "trainer.max_new_tokens=3", "model.exact.stop=true", "kl=kl", "kl.placement=reward"],
          tmp_path / "stop")
    lines = [json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    assert last["step"] == 149 and last["exact/gap"] < UNBIASED_GAP and last["exact/tv_to_optimal"] < 0.03
    assert last["exact/total_probability"] == pytest.approx(1.0, abs=1e-6)
    assert all(2 <= line["response/length_mean"] <= 3 for line in lines)
    assert len({line["response/length_mean"] for line in lines}) > 1
