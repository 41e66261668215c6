"""Speed settings that change no number: logits scaled without a division at temperature 1, and PyTorch's
huge-page allocator switch that rlhf_lab sets by default (and the bench leaves out of TRL's runs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rlhf_lab
from rlhf_lab.ops import scale_logits
from rlhf_lab.tools import bench


def test_scale_logits_skips_the_division_at_temperature_one() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    assert scale_logits(logits, 1.0) is logits  # float32 in, nothing allocated
    assert torch.equal(scale_logits(logits, 1.0), logits / 1.0)  # x / 1 is x exactly
    assert torch.equal(scale_logits(logits, 0.7), logits / 0.7)
    half = logits.bfloat16()
    assert scale_logits(half, 1.0).dtype == torch.float32
    assert torch.equal(scale_logits(half, 1.0), half.float())


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("0", "0")])
def test_importing_rlhf_lab_turns_on_huge_page_allocation_unless_set(given, expected) -> None:
    env = {k: v for k, v in os.environ.items() if k != rlhf_lab.THP_ENV}
    if given is not None:
        env[rlhf_lab.THP_ENV] = given
    code = "import os, rlhf_lab; print(os.environ['THP_MEM_ALLOC_ENABLE'], rlhf_lab.THP_DEFAULTED)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [expected, str(given is None)]


@pytest.mark.parametrize("defaulted", [True, False])
def test_the_bench_runs_trl_without_rlhf_lab_s_default(monkeypatch, tmp_path, defaulted: bool) -> None:
    environments = {}

    def fake_run(command, env, **kwargs):
        environments[command[-2]] = env
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(rlhf_lab, "THP_DEFAULTED", defaulted)
    monkeypatch.setenv(rlhf_lab.THP_ENV, "1")
    for framework in ("rlhf_lab", "trl"):
        result = bench.run_job(bench.Job("grpo_full", framework, [], 1, 0), tmp_path)
        assert result["error"].startswith("child exited with status 1")
    ours, theirs = (environments[str(tmp_path / name)] for name in ("grpo_full_rlhf_lab_0.job.json",
                                                                      "grpo_full_trl_1.job.json"))
    assert ours[rlhf_lab.THP_ENV] == "1"
    assert theirs.get(rlhf_lab.THP_ENV) == (None if defaulted else "1")  # a setting the user made is kept
