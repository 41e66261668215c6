"""End to end: the trainer runs every algorithm × KL estimator × placement and writes the contract files.

All runs use the tiny random Llama (``model=tiny``) in-process, except one real command-line sweep run in
a subprocess as a user would type it. The tokenizer is loaded once per module and shared by every run.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import rlhf_lab.training.loop as trainer_module
from rlhf_lab.data.prompts import PromptSplits, load_prompts
from rlhf_lab.generation.hf import generate
from rlhf_lab.generation.rollout import response_mask_from_tokens
from rlhf_lab.models.loading import build_tiny_llama, load_tokenizer
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.trackers.jsonl import read_jsonl
from rlhf_lab.training.loop import Trainer
from tests.limits import HANG_GUARD_S

ALGORITHMS = ["grpo", "reinforce", "rloo"]
ESTIMATORS = ["kl", "abs", "mse", "k3", "full", "none"]
PLACEMENTS = ["reward", "loss"]
TRAIN_KEYS = [
    "reward/mean", "reward/std", "kl/estimate", "kl/exact", "kl/coef", "loss/policy", "loss/total",
    "policy/entropy", "policy/clipfrac", "response/length_mean", "time/step_s", "throughput/tokens_per_s",
]
TIMING_PREFIXES = ("time/", "throughput/", "perf/")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def shared_tokenizer_and_prompts(compose, tiny_overrides):
    """Load SmolLM2's tokenizer and the embedded prompt set once for the module (together they take about
    as long as a whole tiny run); every Trainer here gets the same tokenizer and a copy of the prompts.
    Local data files are still read by each run."""
    tokenizer = load_tokenizer(compose(tiny_overrides(None)).model)
    embedded: dict[tuple[str, int], PromptSplits] = {}

    def load_prompts_once(data_cfg, seed: int = 0) -> PromptSplits:
        if data_cfg.name != "movie_prompts":
            return load_prompts(data_cfg, seed=seed)
        key = (OmegaConf.to_yaml(data_cfg), seed)
        if key not in embedded:
            embedded[key] = load_prompts(data_cfg, seed=seed)
        return copy.deepcopy(embedded[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "load_tokenizer", lambda model_cfg: tokenizer)
        patch.setattr(trainer_module, "load_prompts", load_prompts_once)
        yield tokenizer


@pytest.fixture
def text_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``reward=python`` spec whose score is a checksum of the response text (spread out, deterministic)."""
    module = tmp_path / "e2e_text_reward.py"
    module.write_text(textwrap.dedent("""
        def checksum(prompts, responses):
            return [sum(map(ord, response)) % 1000 / 1000 for response in responses]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "reward.function=e2e_text_reward:checksum"


def run(compose, overrides: list[str], run_dir: Path) -> tuple[Trainer, dict]:
    trainer = Trainer(compose(overrides), run_dir)
    return trainer, trainer.train()


def train_lines(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def is_finite_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------------------------ the full grid


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_estimator_and_placement_writes_the_contract_files(
    compose, tiny_overrides, tmp_path: Path, algorithm: str, estimator: str, placement: str
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(tmp_path), f"algorithm={algorithm}", f"kl={estimator}", f"kl.placement={placement}",
                 "trainer.samples_per_step_logged=4"]
    trainer, summary = run(compose, overrides, run_dir)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "reward/mean" in r]
    evals = [r for r in lines if "eval/reward/mean" in r]
    assert [r["step"] for r in train] == [0, 1]
    # The eval before training (step 0) and after it (step = steps); nothing else.
    assert len(lines) == len(train) + len(evals) and evals[-1]["step"] == 2
    assert [r["step"] for r in evals] in ([2], [0, 2])
    for record in train:
        bad = {key: record.get(key) for key in TRAIN_KEYS if not is_finite_number(record.get(key))}
        assert not bad, f"missing or non-finite metrics: {bad}"
        assert record["response/length_mean"] == 4.0  # the tiny model never samples EOS in 4 tokens
        assert record["kl/exact"] >= -1e-6  # exact KL, up to float32 rounding while policy = reference
        assert record["kl/coef"] == (0.0 if estimator == "none" else 0.05)
        assert 0.0 <= record["policy/clipfrac"] <= 1.0
    assert all(is_finite_number(r[key]) for r in evals for key in ("eval/reward/mean", "eval/kl/exact"))
    if estimator == "none":
        assert all(r["kl/estimate"] == 0.0 for r in train)
    if estimator == "full":  # the estimate is the exact KL itself
        assert all(r["kl/estimate"] == pytest.approx(r["kl/exact"], rel=1e-4, abs=1e-9) for r in train)
    if estimator in ("abs", "mse", "k3"):
        assert all(r["kl/estimate"] >= 0 for r in train)

    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 8  # 2 steps × 2 prompts × group of 2
    for step, record in enumerate(train):
        rows = [s for s in samples if s["step"] == step]
        assert all(isinstance(s["prompt"], str) and s["prompt"] in trainer.prompts.train for s in rows)
        assert all(isinstance(s["response"], str) for s in rows)
        assert sum(s["reward"] for s in rows) / 4 == pytest.approx(record["reward/mean"], abs=1e-6)

    model_dir = run_dir / "checkpoints" / "step_2" / "model"
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    for name, tensor in trainer.policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    assert json.loads((run_dir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["reward/final"] == train[1]["reward/mean"]
    assert summary["eval/reward/mean"] == evals[-1]["eval/reward/mean"]


# ----------------------------------------------------------------------------------- reproducibility


def test_same_seed_gives_identical_metrics_and_another_seed_does_not(compose, tiny_overrides, tmp_path: Path,
                                                                     text_reward: str) -> None:
    base = [*tiny_overrides(tmp_path), "reward=python", text_reward, "trainer.samples_per_step_logged=4",
            "trainer.lr=1e-3"]
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run(compose, [*base, f"seed={seed}", f"trainer.output_dir={tmp_path / name}"], tmp_path / name)

    def without_timing(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
                for r in read_jsonl(run_dir / "metrics.jsonl")]

    first, second = without_timing(tmp_path / "a"), without_timing(tmp_path / "b")
    assert len(first) >= 3  # 2 steps and the eval(s)
    assert first == second
    assert read_jsonl(tmp_path / "a" / "samples.jsonl") == read_jsonl(tmp_path / "b" / "samples.jsonl")
    rewards = {name: [s["reward"] for s in read_jsonl(tmp_path / name / "samples.jsonl")] for name in "ac"}
    assert len(set(rewards["a"])) > 1  # the reward spreads, so equal lists below would mean equal samples
    assert rewards["a"] != rewards["c"]


# ------------------------------------------------------------------------------------------------ LoRA


def test_lora_trains_only_the_adapter_and_its_reference_is_the_base_model(compose, tiny_overrides,
                                                                          tmp_path: Path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "model.lora.enabled=true", "model.lora.r=4", "trainer.lr=1e-2"])
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.models.reference is None  # no second copy of the network
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()

    after = dict(trainer.policy.named_parameters())
    frozen_changed = [n for n in before if n not in trainable and not torch.equal(before[n], after[n])]
    assert frozen_changed == []
    assert any(not torch.equal(before[n], after[n]) for n in trainable if "lora_B" in n)
    lines = train_lines(tmp_path / "run")
    assert [r["step"] for r in lines] == [0, 1]

    # The reference (adapter disabled) is exactly the base model built from the same seed.
    base = build_tiny_llama(trainer.tokenizer, cfg.model.tiny, seed=cfg.seed).eval()
    torch.manual_seed(0)
    rollout = generate(trainer.policy, trainer.tokenizer, ["A short prompt", "A somewhat longer prompt here"], 2, 4,
                       1.0, 1.0, 0, 256, keep_logits=False)
    inputs = (rollout.input_ids, rollout.attention_mask, rollout.prompt_width, 1.0)
    with torch.no_grad():
        with trainer.models.reference_context():
            reference_logits, _ = response_logits(trainer.models.reference_model(), *inputs)
        base_logits, _ = response_logits(base, *inputs)
        policy_logits, _ = response_logits(trainer.policy, *inputs)
    torch.testing.assert_close(reference_logits, base_logits, rtol=0, atol=1e-5)
    assert (policy_logits - base_logits).abs().max() > 1e-3  # the trained adapter does change the policy

    model_dir = tmp_path / "run" / "checkpoints" / "step_2" / "model"
    assert (model_dir / "adapter_model.safetensors").is_file()
    assert json.loads((model_dir / "adapter_config.json").read_text())["r"] == 4


# ------------------------------------------------------------------------------------ KL controller


def test_adaptive_kl_controller_moves_the_coefficient(compose, tiny_overrides, tmp_path: Path) -> None:
    overrides = [*tiny_overrides(tmp_path), "kl.controller=adaptive", "kl.target=1.0", "kl.horizon=10"]
    run(compose, overrides, tmp_path / "run")
    first, second = train_lines(tmp_path / "run")
    # The measured KL per sequence is far below the target 1.0, so the error clips at −0.2 and
    # β ← β·(1 − 0.2·4/10) with 4 samples per step: 0.05 · 0.92 = 0.046.
    assert first["kl/exact_sequence"] < 0.8
    assert first["kl/coef"] == 0.05
    assert second["kl/coef"] == pytest.approx(0.046, rel=1e-9)


# ---------------------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batches_give_the_same_update(compose, tiny_overrides, tmp_path: Path, aggregation: str) -> None:
    """One fixed rollout (with responses of different lengths), trained on once whole and once in two
    micro-batches: the accumulated gradient and the parameter update agree."""
    base = [*tiny_overrides(tmp_path), "kl=k3", "kl.placement=loss", "algorithm.entropy_coef=0.01",
            "trainer.lr=3e-4", "trainer.max_grad_norm=null", f"algorithm.loss_aggregation={aggregation}",
            "trainer.eval_prompts=0"]
    whole = Trainer(compose(base), tmp_path / "whole")
    micro = Trainer(compose([*base, "trainer.micro_batch_size=2"]), tmp_path / "micro")
    assert micro.cfg.trainer.micro_batch_size == 2

    fixed = []
    original_sample = whole.experience.sample_and_score

    def rollout_cut_short(*args, **kwargs):
        result = original_sample(*args, **kwargs)  # (rollout, responses, valid), before the reference pass
        rollout = result[0]
        # Rows end after 4, 3, 1 and 2 tokens: the two micro-batches hold 7 and 3 tokens.
        eos = whole.tokenizer.eos_token_id
        response_ids = rollout.response_ids.clone()
        for row, last in enumerate([3, 2, 0, 1]):
            response_ids[row, last:] = eos
        mask = response_mask_from_tokens(response_ids, eos)
        rollout.input_ids[:, rollout.prompt_width :] = response_ids
        rollout.attention_mask[:, rollout.prompt_width :] = mask.long()
        rollout = dataclasses.replace(rollout, response_mask=mask, logprobs=rollout.logprobs * mask,
                                      entropy=rollout.entropy * mask)  # the scored batch is frozen
        result = (rollout, *result[1:])
        fixed.append(copy.deepcopy(result))
        return result

    whole.experience.sample_and_score = rollout_cut_short
    micro.experience.sample_and_score = lambda *args, **kwargs: copy.deepcopy(fixed[0])

    def grads_at_step(trainer: Trainer) -> list[list[torch.Tensor]]:
        captured = []
        trainer.updater.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: captured.append([p.grad.clone() for p in trainer.updater.parameters])
        )
        return captured

    whole_grads, micro_grads = grads_at_step(whole), grads_at_step(micro)
    start = [p.detach().clone() for p in whole.updater.parameters]
    for p, q in zip(start, micro.updater.parameters):
        assert torch.equal(p, q)
    whole_metrics = whole.train_step(0)
    micro_metrics = micro.train_step(0)
    assert fixed[0][0].response_mask.sum(-1).tolist() == [4.0, 3.0, 1.0, 2.0]

    assert len(whole_grads) == len(micro_grads) == 1
    for whole_grad, micro_grad in zip(whole_grads[0], micro_grads[0]):
        # float32 sums in another order: entries that cancel to near zero keep an error on the scale of the
        # tensor's largest terms (up to 1.3e-5 of its largest entry on some CPUs' kernels)
        torch.testing.assert_close(micro_grad, whole_grad, rtol=1e-4, atol=1e-4 * whole_grad.abs().max().item())
    largest_update = 0.0
    for p0, p_whole, p_micro in zip(start, whole.updater.parameters, micro.updater.parameters):
        torch.testing.assert_close(p_micro.detach() - p0, p_whole.detach() - p0, rtol=0, atol=1e-5)
        largest_update = max(largest_update, (p_whole.detach() - p0).abs().max().item())
    assert largest_update > 1e-4  # a real step was taken (Adam's first step moves weights by about lr)
    for key in ("loss/policy", "loss/total", "loss/kl", "policy/clipfrac"):
        assert micro_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-4, abs=1e-7), key


# --------------------------------------------------------------------------------------- local data


def test_prompts_from_a_local_jsonl_folder_and_a_csv_file(compose, tiny_overrides, tmp_path: Path) -> None:
    folder = tmp_path / "jsonl_data"
    folder.mkdir()
    train_prompts = [f"Describe fruit number {i} in one line." for i in range(6)]
    eval_prompts = [f"Name vegetable number {i}." for i in range(3)]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": p, "id": i}) + "\n"
                                                for i, p in enumerate(train_prompts)))
    (folder / "eval.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in eval_prompts))
    jsonl_dir = tmp_path / "from_jsonl"
    trainer, summary = run(compose, [*tiny_overrides(tmp_path), "data=jsonl", f"data.path={folder}",
                                     "data.prompt_column=text", f"trainer.output_dir={jsonl_dir}"], jsonl_dir)
    assert trainer.prompts.train == train_prompts and trainer.prompts.eval == eval_prompts
    samples = read_jsonl(jsonl_dir / "samples.jsonl")
    assert samples and all(s["prompt"] in train_prompts for s in samples)
    assert "eval/reward/mean" in summary

    csv_file = tmp_path / "questions.csv"
    questions = [f"Why is the sky number {i} blue?" for i in range(8)]
    csv_file.write_text("question,other\n" + "".join(f'"{q}",{i}\n' for i, q in enumerate(questions)))
    csv_dir = tmp_path / "from_csv"
    trainer, summary = run(compose, [*tiny_overrides(tmp_path), "data=csv", f"data.path={csv_file}",
                                     "data.prompt_column=question", "data.eval_fraction=0.25",
                                     f"trainer.output_dir={csv_dir}"], csv_dir)
    assert sorted(trainer.prompts.train + trainer.prompts.eval) == sorted(questions)
    assert len(trainer.prompts.eval) == 2  # 0.25 of 8
    samples = read_jsonl(csv_dir / "samples.jsonl")
    assert samples and all(s["prompt"] in trainer.prompts.train for s in samples)
    assert "eval/reward/mean" in summary


# --------------------------------------------------------------------------- a command-line sweep


def test_command_line_sweep_writes_one_folder_per_job(tiny_overrides, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    command = [sys.executable, "-m", "rlhf_lab", "-m", "algorithm=grpo,rloo", "kl=k3,kl", "kl.placement=loss,reward",
               *tiny_overrides(None), f"hydra.sweep.dir={sweep_dir}"]
    assert "model=tiny" in command and not any(a.startswith("trainer.output_dir") for a in command)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.perf_counter() - start < 300

    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert len(jobs) == 8, [p.name for p in jobs]
    seen = set()
    for job in jobs:
        assert job.name.split("_")[0].isdigit()  # job number + a short label; the overrides are in .hydra/
        overrides = dict(str(line).split("=", 1) for line in OmegaConf.load(job / ".hydra" / "overrides.yaml"))
        config = OmegaConf.load(job / ".hydra" / "config.yaml")
        assert config.algorithm.name == overrides["algorithm"]
        assert config.kl.name == overrides["kl"]
        assert config.kl.placement == overrides["kl.placement"]
        assert config.model.name == "tiny" and config.trainer.output_dir is None
        assert [r["step"] for r in train_lines(job)] == [0, 1]
        assert (job / "checkpoints" / "step_2" / "model").is_dir()
        seen.add((overrides["algorithm"], overrides["kl"], overrides["kl.placement"]))
    assert seen == set(itertools.product(["grpo", "rloo"], ["k3", "kl"], ["loss", "reward"]))
    assert not (tmp_path / "outputs").exists()  # nothing written outside the sweep folder
