"""Every step logs ``perf/peak_memory_gib``, ``perf/tokens_per_s`` and ``perf/mfu`` (where the device's peak is
known), each documented in docs/reference/metrics.md."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from rlhf_lab.training.loop import Trainer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"


def test_each_step_logs_its_peak_memory_tokens_per_second_and_mfu(compose, tiny_overrides, tmp_path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "trainer.eval_prompts=0", "trainer.peak_tflops=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.train()
    per_sampled, per_trained = trainer.performance.flops_per_token()
    assert per_trained > 0 and per_sampled > 0  # (a sampled token also carries its prompt's prefill)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "perf/tokens_per_s" in line]
    assert len(steps) == 2
    for line in steps:
        # 4 rows of up to 4 sampled tokens; trained: every attended token of the rows (one epoch)
        sampled = line["response/length_mean"] * 4
        trained = line["throughput/tokens_per_s"] * line["time/step_s"]
        assert line["perf/tokens_per_s"] == pytest.approx((sampled + trained) / line["time/step_s"], rel=1e-6)
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / (1 << 30)
        assert 0 < line["perf/peak_memory_gib"] <= peak_rss
        flops = per_sampled * sampled + per_trained * trained
        assert line["perf/mfu"] == pytest.approx(flops / (line["time/step_s"] * 1e12), rel=1e-3)
    text = DOCS.read_text(encoding="utf-8")
    assert all(f"`{name}`" in text for name in ("perf/peak_memory_gib", "perf/tokens_per_s", "perf/mfu"))


def test_no_mfu_where_the_device_peak_is_unknown(compose, tiny_overrides, tmp_path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "trainer.eval_prompts=0", "trainer.steps=1"])
    Trainer(cfg, tmp_path / "run").train()
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "perf/mfu" not in line and line["perf/peak_memory_gib"] > 0


@pytest.mark.parametrize("shape", [(48, 4, 2), (16, 24, 4)])
def test_the_flops_per_token_give_the_planned_step_at_its_prompt_and_response_lengths(compose, tiny_overrides,
                                                                                     tiny_tokenizer, shape) -> None:
    """The rates the MFU uses (one prompt group planned at the step's prompt length) times a whole step's tokens
    give the planner's count of that whole step, whatever the split of prompt and response tokens (a group's prompt
    computed once; the LM head on response tokens only). The planned step's prompts differ in length as a real
    batch's do, and its passes compute the left padding too: its trained rows count at their padded width (a run's
    MFU counts its real tokens only, the FLOPs that are the model's)."""
    from rlhf_lab.planner.step import plan_step
    from rlhf_lab.runtime.precision import Precision
    from rlhf_lab.training.perf import StepPerformance

    prompt, response, groups = shape
    cfg = compose([*tiny_overrides(None), f"trainer.max_new_tokens={response}", f"trainer.prompts_per_step={groups}",
                   "algorithm.group_size=4", "trainer.precision=fp32"])
    precision = Precision("fp32", "cpu")
    per_sampled, per_trained = StepPerformance(cfg, tiny_tokenizer, precision, torch.device("cpu")).flops_per_token(prompt)
    step = plan_step(cfg, tiny_tokenizer, precision, prompt_tokens=prompt)
    assert step.tokens["trained"] < step.rows * step.sequence_tokens  # padded
    estimate = per_sampled * step.tokens["sampled"] + per_trained * step.rows * step.sequence_tokens
    assert estimate == pytest.approx(step.flops_per_step, rel=0.05)


def test_on_a_gpu_the_peak_is_the_step_s_own(compose, tiny_overrides, tiny_tokenizer, monkeypatch) -> None:
    """The CUDA allocator's peak is reset as each step starts (``Trainer.train_step``), so each step logs its own."""
    from rlhf_lab.runtime.precision import Precision
    from rlhf_lab.training.perf import StepPerformance

    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: reset.append(device))
    cfg = compose([*tiny_overrides(None), "trainer.peak_tflops=1"])
    StepPerformance(cfg, tiny_tokenizer, Precision("fp32", "cpu"), torch.device("cpu")).step_started()
    assert reset == []
    StepPerformance(cfg, tiny_tokenizer, Precision("fp32", "cuda"), torch.device("cuda")).step_started()
    assert reset == [torch.device("cuda")]
