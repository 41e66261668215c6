"""``make gpu-bundle`` carries the pinned transformers (and what it needs beyond the GPU image), so a GPU run executes
the attention code the CPU calibrated: the image's transformers 5.17 expands K and V under a padding mask where the
pinned one does not, and a plan made with one does not hold for the other."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def make_variable(name: str) -> str:
    result = subprocess.run(["make", "-s", "--no-print-directory", "--eval", f"print-it: ; @echo $({name})", "print-it"],
                            cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    return result.stdout.strip()


def pins(text: str) -> dict[str, str]:
    """name -> version of every ``name==version`` (names normalised as pip does)."""
    return {re.sub(r"[-_.]+", "-", name).lower(): version
            for name, version in re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s#;]+)", text, flags=re.MULTILINE)}


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_the_bundle_carries_the_pinned_transformers_and_its_own_stack() -> None:
    bundled = pins("\n".join(make_variable("GPU_MODEL_WHEELS").split()))
    pinned = pins((ROOT / "requirements.txt").read_text())
    for package in ("transformers", "tokenizers", "huggingface-hub", "safetensors", "peft", "accelerate"):
        assert bundled.get(package) == pinned[package], (package, bundled.get(package), pinned[package])
    assert make_variable("TRANSFORMERS_PIN") == pinned["transformers"]
    # What the pinned huggingface_hub needs at import that a transformers-5.17 image may not have.
    for package in ("httpx2", "httpcore2", "hf-xet", "click"):
        assert package in bundled, package


def test_the_gpu_check_s_time_limits_add_up_to_480_seconds() -> None:
    """benchmarks/gpu_check.sh is a lent device's first call: its parts' default limits add up to 480 s, and every
    part that runs a program runs under one of them."""
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    limits = {name: int(value) for name, value in re.findall(r"(\w+_S)=\$\{\1:-(\d+)\}", script)}
    assert set(limits) == {"SETUP_S", "TEST_GPU_S", "BENCH_S", "ROW_S", "PLAN_S"}
    plans = script.count('timeout "$PLAN_S"') * len(re.search(r"for row in ([\w ]+);", script).group(1).split())
    uses = {name: script.count(f'timeout "${name}"') for name in limits}
    assert all(uses.values()), uses
    total = sum(limits[name] for name in limits if name != "PLAN_S") + plans * limits["PLAN_S"]
    assert total == 480, limits
    for program in ("-m benchmarks.bench", "-m rlhf_lab ", "-m rlhf_lab plan", "make test-gpu", "pip install"):
        for line in [line for line in script.splitlines() if program in line and not line.lstrip().startswith("#")]:
            assert "timeout" in line or "fallback" in line, line
