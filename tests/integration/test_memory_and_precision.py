"""Memory savers and mixed precision on the tiny model, in-process.

Each saver is checked for the memory it is meant to save, measured directly (bytes kept for backward, the
largest logits tensor of the reference pass, where the reference lives between passes) and for leaving the
numbers alone: the same rollout scored or trained with and without it agrees to float tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import rlhf_lab.step.scoring_pass as scoring_module
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.training.loop import Trainer

WIDER = ["model.tiny.hidden_size=128", "model.tiny.intermediate_size=256", "model.tiny.num_hidden_layers=4",
         "trainer.max_new_tokens=8", "trainer.prompts_per_step=2", "algorithm.group_size=4", "trainer.eval_prompts=0"]


def make_trainer(compose, tiny_overrides, run_dir: Path, *overrides: str) -> Trainer:
    return Trainer(compose([*tiny_overrides(None), *WIDER, *overrides]), run_dir)


def scored_rollout(trainer: Trainer):
    torch.manual_seed(0)
    experience = trainer.experience.make(trainer.prompts.train[:2], 4, StepTimer(), ["a", "b"], kl_coef=0.05)
    return experience.rollout


def sampled_rollout(trainer: Trainer):
    """Sampled and rewarded, before the scoring pass (the engine keeping its logits for the exact KL)."""
    torch.manual_seed(0)
    trainer.experience.engine.keep_logits = True
    rollout, _, _ = trainer.experience.sample_and_score(trainer.prompts.train[:2], 4, StepTimer(), ["a", "b"])
    return rollout


def saved_bytes_and_grads(trainer: Trainer, rollout) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps for backward during one update of ``rollout``, and the gradients it produced."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    rollout = rollout.for_training()  # the training batch of the scored one
    rollout, _ = trainer.algorithm.prepare(rollout, trainer.updater.forward)
    grads = []
    trainer.updater.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: grads.extend(p.grad.clone() for p in trainer.updater.parameters))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.updater.update(rollout, 0.05, 0, StepTimer())
    return total, grads


def test_gradient_checkpointing_keeps_less_for_backward_and_the_same_gradient(compose, tiny_overrides, tmp_path):
    plain = make_trainer(compose, tiny_overrides, tmp_path / "plain")
    checkpointed = make_trainer(compose, tiny_overrides, tmp_path / "ckpt", "trainer.gradient_checkpointing=true")
    rollout = scored_rollout(plain)
    plain_bytes, plain_grads = saved_bytes_and_grads(plain, copy.deepcopy(rollout))
    ckpt_bytes, ckpt_grads = saved_bytes_and_grads(checkpointed, copy.deepcopy(rollout))
    assert ckpt_bytes < 0.6 * plain_bytes, (ckpt_bytes, plain_bytes)
    for want, got in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_default_recomputation_keeps_less_for_backward_and_the_same_gradient_bit_for_bit(
        compose, tiny_overrides, tmp_path, precision):
    plain = make_trainer(compose, tiny_overrides, tmp_path / "plain", "trainer.recompute=[]",
                         f"trainer.precision={precision}")
    default = make_trainer(compose, tiny_overrides, tmp_path / "default", f"trainer.precision={precision}",
                           "hardware.recompute=true")  # cpu_tuned's choice under trainer.recompute=null
    assert plain.updater.recompute == [] and len(default.updater.recompute) == 3 * 4  # norms and MLP, 4 layers
    rollout = scored_rollout(plain)
    plain_bytes, plain_grads = saved_bytes_and_grads(plain, copy.deepcopy(rollout))
    default_bytes, default_grads = saved_bytes_and_grads(default, copy.deepcopy(rollout))
    # (which tensors it drops: tests/unit/test_recompute.py; here the [B, T, V] logits dominate both counts)
    assert default_bytes < plain_bytes, (default_bytes, plain_bytes)
    assert len(plain_grads) == len(default_grads) > 0
    for want, got in zip(plain_grads, default_grads, strict=True):
        assert torch.equal(got, want)


def test_chunked_reference_bounds_the_logits_and_gives_the_same_terms(compose, tiny_overrides, tmp_path,
                                                                        monkeypatch):
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "kl=mse", "kl.placement=reward")
    rollout = sampled_rollout(trainer)
    sizes = []
    original = scoring_module.response_logits

    def recording(*args, **kwargs):
        logits, hidden = original(*args, **kwargs)
        sizes.append(logits.numel())
        return logits, hidden

    monkeypatch.setattr(scoring_module, "response_logits", recording)
    whole, chunked = copy.deepcopy(rollout), copy.deepcopy(rollout)
    whole = dataclasses.replace(whole, **trainer.experience.scoring(whole, StepTimer(), exact=True))
    trainer.cfg.trainer.logprob_chunk = 2
    chunked = dataclasses.replace(chunked, **trainer.experience.scoring(chunked, StepTimer(), exact=True))
    assert sizes[0] == 4 * max(sizes[1:])  # 8 rows at once, then 2 at a time
    assert len(sizes) == 1 + 4
    for key in ("ref_logprobs", "kl_estimate", "kl_exact"):
        torch.testing.assert_close(getattr(chunked, key), getattr(whole, key), rtol=1e-5, atol=1e-6)
    assert chunked.ref_logits is None  # not kept: the update does not need them (mse in the reward)


def test_offloaded_reference_visits_the_device_only_for_its_pass(compose, tiny_overrides, tmp_path, monkeypatch):
    """``trainer.offload_reference``: the reference's weights live in host memory (pinned on a GPU run); for its pass
    each is copied to the device once, non-blocking, and after it they are the same host tensors again (nothing
    copied back, nothing allocated anew); the numbers are those of a reference that never moved."""
    plain = make_trainer(compose, tiny_overrides, tmp_path / "plain")
    offloaded = make_trainer(compose, tiny_overrides, tmp_path / "offloaded", "trainer.offload_reference=true")
    reference, host_weights = offloaded.models.reference, offloaded.models.host_weights
    assert host_weights is not None and plain.models.host_weights is None
    host = [tensor.data_ptr() for tensor in host_weights.host]
    assert [t.data_ptr() for t in [*reference.parameters(), *reference.buffers()]] == host
    copies, during = [], []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        if kwargs.get("non_blocking"):
            copies.append(str(args[0]))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    reference.register_forward_pre_hook(lambda module, args: during.append({p.device.type for p in module.parameters()}))
    rollout = sampled_rollout(plain)
    a, b = copy.deepcopy(rollout), copy.deepcopy(rollout)
    a = dataclasses.replace(a, **plain.experience.scoring(a, StepTimer(), exact=True))
    b = dataclasses.replace(b, **offloaded.experience.scoring(b, StepTimer(), exact=True))
    assert copies == [str(offloaded.device)] * len(host)  # every weight and buffer once, in the pass
    assert during and all(devices == {offloaded.device.type} for devices in during)
    assert [t.data_ptr() for t in [*reference.parameters(), *reference.buffers()]] == host
    assert all(p.device.type == "cpu" for p in reference.parameters())
    for key in ("ref_logprobs", "kl_estimate", "kl_exact"):
        assert torch.equal(getattr(a, key), getattr(b, key))


def test_bf16_mixed_trains_fp32_master_weights_with_bf16_compute(compose, tiny_overrides, tmp_path):
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "trainer.precision=bf16-mixed",
                           "trainer.steps=2")
    dtypes = set()
    layer = next(m for m in trainer.policy.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    summary = trainer.train()
    assert dtypes == {torch.bfloat16}  # generation, reference and training passes all ran under autocast
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())
    states = [s for s in trainer.updater.optimizer.state.values() if "exp_avg" in s]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert summary["reward/final"] == summary["reward/final"]  # finite, not NaN
    # The frozen reference keeps its matrices in bf16 (what autocast multiplied by anyway); the tied LM head
    # stays with its float32 embedding.
    reference = trainer.models.reference
    assert {m.weight.dtype for m in reference.modules()
            if isinstance(m, torch.nn.Linear) and m is not reference.lm_head} == {torch.bfloat16}
    assert reference.lm_head.weight.dtype == torch.float32


def test_bf16_mixed_lora_trains_evaluates_and_resumes(compose, tiny_overrides, tmp_path):
    """LoRA under bf16-mixed: the frozen base in bf16, the adapters (and their Adam state) in float32; the
    evaluation (generation with merged adapters, the reference with the adapter off) and a resume run."""
    lora = ["trainer.precision=bf16-mixed", "model.lora.enabled=true", "model.lora.r=4", "trainer.eval_prompts=2",
            "trainer.checkpoint_every=1"]
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", *lora, "trainer.steps=2")
    summary = trainer.train()
    dtypes = {name: p.dtype for name, p in trainer.policy.named_parameters()}
    assert {dtypes[n] for n in dtypes if "lora_" in n} == {torch.float32}
    assert {dtypes[n] for n in dtypes if "base_layer" in n} == {torch.bfloat16}
    assert all(all(v.dtype == torch.float32 for v in state.values() if v.dim())
               for state in trainer.updater.optimizer.state.values())
    assert summary["reward/final"] == summary["reward/final"]
    resumed = make_trainer(compose, tiny_overrides, tmp_path / "run", *lora, "trainer.steps=3", "trainer.resume=auto")
    assert resumed.start_step == 2
    resumed.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "kl/exact" in row] == [0, 1, 2]  # training steps, once each
    assert all(row[key] == row[key] for row in rows for key in ("kl/exact", "eval/kl/exact") if key in row)


def test_bf16_true_stores_the_weights_in_bf16(compose, tiny_overrides, tmp_path):
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "trainer.dtype=bfloat16")
    assert trainer.precision.name == "bf16-true"
    assert {p.dtype for p in trainer.policy.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(("saver", "lora"), [("trainer.gradient_checkpointing=true", False),
                                             ("trainer.gradient_checkpointing=true", True),
                                             ("trainer.logprob_chunk=3", False),
                                             ("trainer.offload_reference=true", False)])
def test_each_saver_leaves_a_run_s_metrics_alone(compose, tiny_overrides, tmp_path, saver: str, lora: bool):
    """Under LoRA with gradient checkpointing (the 1-GPU recipe of docs/guides/scale-out.md) the reference is the
    adapter-disabled policy in training mode, whose forward keeps no cache: its pass runs every row whole."""
    base = [*tiny_overrides(None), "trainer.steps=2", "trainer.eval_prompts=0", "kl=k3", "kl.placement=loss",
            f"model.lora.enabled={str(lora).lower()}"]
    runs = []
    for name, overrides in (("plain", base), ("saving", [*base, saver])):
        Trainer(compose(overrides), tmp_path / name).train()  # one at a time: each seeds the generators
        runs.append([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    assert len(runs[0]) == len(runs[1]) == 2
    for want, got in zip(*runs):
        for key, value in want.items():
            if not key.startswith(("time/", "throughput/", "perf/")):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
