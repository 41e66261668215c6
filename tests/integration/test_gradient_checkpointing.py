"""``trainer.gradient_checkpointing`` recomputes the policy's layers in its training pass, in eval mode too.

transformers checkpoints a layer only while that layer is in training mode; a policy from ``from_pretrained``
is in eval mode (and stays so: no dropout in any pass), and there the setting recomputed nothing: every layer's
activations were kept, as without it (a real model's GPU step at the CUDA defaults then held what the planner
said it would not). The tiny policy is put in eval mode here, as a pretrained one is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.llama import modeling_llama

from rlhf_lab.training.loop import Trainer


def one_update(tmp_path: Path, compose, tiny_overrides, checkpointing: bool, monkeypatch) -> tuple[dict, int, float]:
    """(step metrics, MLP forwards run again by a backward pass, the first layer's gradient norm) of step 0."""
    cfg = compose([*tiny_overrides(tmp_path), "trainer.steps=1", "trainer.eval_prompts=0", "reward=length",
                   f"trainer.gradient_checkpointing={str(checkpointing).lower()}", "trainer.recompute=[]",
                   "trainer.max_grad_norm=1e9"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.policy.eval()  # as from_pretrained leaves it
    recomputed = []
    forward = modeling_llama.LlamaMLP.forward

    def counted(self, x):
        recomputed.append(torch._C._current_graph_task_id() != -1)  # inside a backward pass: a recomputation
        return forward(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", counted)
    norms = []
    step = trainer.updater.optimizer_step

    def before_the_step(*args, **kwargs):  # the gradients the backward made, read before AdamW changes anything
        norms.append(next(trainer.policy.parameters()).grad.norm().item())
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer.updater, "optimizer_step", before_the_step)
    metrics = trainer.train_step(0)
    trainer.records.close()
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", forward)
    assert not any(layer.training for layer in trainer.policy.modules())  # the flags put back after the pass
    return metrics, sum(recomputed), norms[0]


def test_an_eval_mode_policy_recomputes_its_layers_and_gets_the_same_gradients(tmp_path: Path, compose,
                                                                                tiny_overrides, monkeypatch) -> None:
    plain, plain_recomputed, plain_norm = one_update(tmp_path / "plain", compose, tiny_overrides, False, monkeypatch)
    checkpointed, recomputed, norm = one_update(tmp_path / "ckpt", compose, tiny_overrides, True, monkeypatch)
    layers = compose(tiny_overrides(None)).model.tiny.num_hidden_layers
    assert plain_recomputed == 0
    assert recomputed >= layers  # every layer's MLP ran again in the backward pass (once per micro-batch)
    assert recomputed % layers == 0
    assert checkpointed["loss/total"] == pytest.approx(plain["loss/total"], abs=1e-7)  # ~0 at a first update
    assert plain_norm > 0 and norm == pytest.approx(plain_norm, rel=1e-5)
