"""Smoke test: the embedded default (SmolLM2-135M-Instruct, movie prompts, sentiment reward) trains for two
steps through the command line, exactly as ``rlhf-lab`` runs it. The only test that runs the real model.

The first run on a machine builds the model cache under ~/.cache/rlhf_lab (about 30 s). The subprocess
inherits ``OMP_NUM_THREADS=1`` from conftest.py (an environment setting, not a config override): on the
shared machine two threads make this run 3-4 times slower.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf_lab.trackers.jsonl import read_jsonl
from tests.limits import HANG_GUARD_S


@pytest.mark.slow
def test_embedded_default_trains_two_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rlhf_lab", "trainer.steps=2", "trainer.eval_prompts=2",
               f"trainer.output_dir={run_dir}"]
    assert os.environ["OMP_NUM_THREADS"] == "1"
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr

    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [0, 1]
    for record in train:
        for key in ("reward/mean", "kl/estimate", "kl/exact", "loss/total"):
            assert math.isfinite(record[key]), (key, record[key])
        assert -1.0 <= record["reward/mean"] <= 1.0  # VADER compound sentiment
        assert record["kl/exact"] >= -1e-6  # float32 rounding around 0 at the first step
        assert 1 <= record["response/length_mean"] <= 32
    assert any("eval/reward/mean" in r for r in records)
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples and any(s["response"].strip() for s in samples)  # a real model writes words

    model_dir = run_dir / "checkpoints" / "step_2" / "model"
    assert (model_dir / "config.json").is_file()
    assert list(model_dir.glob("*.safetensors"))
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"
    hydra_config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")  # the resolved config, in the run folder
    assert hydra_config.model.name == "smollm2_135m" and hydra_config.trainer.steps == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
