"""``make test-gpu`` on a machine without CUDA stops at once, non-zero, with one line: a GPU check never passes by
skipping every test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make test-gpu runs the GPU tests")
@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_test_gpu_without_cuda_fails_with_one_line() -> None:
    result = subprocess.run(["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode != 0
    assert result.stderr.splitlines()[0] == "no CUDA device: nothing was tested", result.stderr
    assert "passed" not in result.stdout and "skipped" not in result.stdout
