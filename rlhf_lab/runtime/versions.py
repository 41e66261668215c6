"""What a figure was measured or planned with: torch, transformers and peft, the attention code transformers ran,
and the device by name.

Every plan (``rlhf-lab plan``'s JSON line), bench JSON (each run's facts) and GPU log records it
(:func:`environment`), and a plan asked to stand for a run of other versions says so in one line
(:func:`check_reproducible`): the first GPU run of the project measured transformers 5.17 against a plan made with
5.23, and the 40% gap between them was the two versions' attention code (5.17's SDPA path copies K and V under a
padding mask), not the planner.
"""

from __future__ import annotations

import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rlhf_lab.errors import ToolError

PACKAGES = ("torch", "transformers", "peft")
COMPARED = ("torch", "transformers", "attention")  # what changes a plan's numbers; the device is the plan's own


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """The GPU's name for ``cuda`` (``cuda, none visible`` where this process sees none: a plan made elsewhere),
    the CPU's otherwise."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda, none visible"
    return cpu_name()


def environment(device: str, attention: str | None) -> dict[str, str | None]:
    """``{"torch", "transformers", "peft", "attention", "device"}``: the installed versions (None: not installed),
    the attention implementation of the model the figure ran (``config._attn_implementation``), the device."""
    return {**{name: package_version(name) for name in PACKAGES}, "attention": attention, "device": device_name(device)}


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``"transformers 5.23.0 here, 5.17.0 there"`` for each of :data:`COMPARED` both name and name differently."""
    return [f"{key} {ours[key]} here, {theirs[key]} there" for key in COMPARED
            if ours.get(key) and theirs.get(key) and str(ours[key]) != str(theirs[key])]


def read_versions(path: Path) -> dict[str, str]:
    """A ``versions.json`` (``benchmarks/gpu_check.sh``'s, or a plan's ``versions``): a JSON object of strings. A
    file someone else wrote: anything else is one line naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise ToolError(f"--versions {path}: cannot read it as JSON ({reason})") from None
    if not isinstance(data, dict) or not any(isinstance(data.get(key), str) for key in COMPARED):
        raise ToolError(f"--versions {path}: not a versions file (a JSON object naming at least one of "
                        f"{', '.join(COMPARED)}, as benchmarks/gpu_check.sh writes)")
    return {key: str(value) for key, value in data.items() if isinstance(value, str | int | float)}


def check_reproducible(ours: dict[str, Any], wanted: dict[str, Any], source: str) -> None:
    """One line where the versions ``wanted`` (read from ``source``) are not the ones this process runs: a plan
    runs the installed code on fake tensors and cannot stand for another version's."""
    found = differences(ours, wanted)
    if found:
        raise ToolError(f"a plan for the versions of {source} cannot be made here: {'; '.join(found)} (a plan runs the "
                        "installed code); plan where those versions are installed (make gpu-bundle carries the pinned "
                        "ones), or leave out --versions")
