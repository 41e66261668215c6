"""A plan for a device: the step's phases on ``world_size`` processes, the engine's reservation, fit and MFU.

:func:`rlhf_lab.planner.step.plan_step` runs the step of one process. Here the plan is read for a device:

- processes: each rank holds whole prompt groups (``trainer.prompts_per_step / N`` prompts); under
  ``trainer.strategy=fsdp`` the step is planned sharded (FSDP2 over a fake process group of N ranks: the shards,
  the all-gathered layers, the reduce-scattered gradients); where a process group already exists (the trainer's
  own check under torchrun) the weights, the reference and the optimizer's state are divided by N instead;
- the engine's reservation: vLLM colocated on a GPU holds ``generation.gpu_memory_utilization`` of the device
  while it samples, and keeps it through the training pass unless it sleeps (``generation.sleep``);
- MFU: the step's FLOPs over its time and the device's peak throughput.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lab.planner.step import GIB, StepPlan
from rlhf_lab.runtime.versions import environment

# Dense bf16 peak (TFLOP/s) of the GPUs the name says; elsewhere ``trainer.peak_tflops`` / ``--peak-tflops``.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}


def peak_tflops_of(device_name: str) -> float | None:
    """The bf16 dense peak of a GPU by its name (``torch.cuda.get_device_name``); None for one not listed."""
    return next((value for key, value in PEAK_TFLOPS.items() if key in device_name.upper()), None)


@dataclass
class DevicePlan:
    """The step's memory on one process of ``world_size``, against ``device_memory`` (bytes)."""

    step: StepPlan
    device: str
    world_size: int
    device_memory: int | None
    sharded: bool
    engine_reservation: int
    engine_sleeps: bool

    def phases(self) -> dict[str, int]:
        """Bytes by phase: the states held through the step, then each phase's peak (all held at that moment)."""
        step = self.step  # sharded by the plan itself (FSDP over a fake group), else divided here
        shards = self.world_size if self.sharded and step.sharded_over == 1 else 1
        static = step.weights + step.reference + step.optimizer
        saved = static - static // shards  # what sharding takes off every phase's peak
        held = 0 if self.engine_sleeps else self.engine_reservation
        generation = step.peaks["generation"] - saved
        if self.engine_reservation:  # the engine samples in its own memory: the trainer holds its states only
            generation = static // shards + self.engine_reservation
        return {"weights": step.weights // shards, "reference": step.reference // shards,
                "optimizer": step.optimizer // shards, "kv_cache": step.kv_cache,
                "generation": generation, "scoring": step.peaks["scoring"] - saved + held,
                "training": step.peaks["training"] - saved + held, "engine_reservation": self.engine_reservation}

    @property
    def peak(self) -> int:
        phases = self.phases()
        return max(phases["generation"], phases["scoring"], phases["training"])

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak <= self.device_memory

    def mfu(self, peak_tflops: float | None, step_seconds: float | None) -> float | None:
        """The model FLOPs utilisation of a step of ``step_seconds`` (every rank's FLOPs over every rank's peak)."""
        if not peak_tflops or not step_seconds:
            return None
        return self.step.flops_per_step / (step_seconds * peak_tflops * 1e12)

    def summary(self, peak_tflops: float | None, step_seconds: float | None) -> dict[str, Any]:
        """The last line of ``rlhf-lab plan``: GiB per phase, the peak, whether it fits, FLOPs per step."""
        fits = self.fits
        result: dict[str, Any] = {
            "peak_gib": round(self.peak / GIB, 3), "fits": fits if fits is not None else True,
            "phases": {name: round(value / GIB, 3) for name, value in self.phases().items()},
            "flops_per_step": self.step.flops_per_step, "device": self.device, "world_size": self.world_size,
            "device_memory_gib": None if self.device_memory is None else round(self.device_memory / GIB, 3),
            "tokens_per_step": self.step.tokens, "rows_per_rank": self.step.rows,
            "sequence_tokens": self.step.sequence_tokens, "versions": environment(self.device, self.step.attention),
        }
        if peak_tflops:
            result["peak_tflops"] = peak_tflops
            result["seconds_at_peak"] = self.step.flops_per_step / (peak_tflops * 1e12)
        mfu = self.mfu(peak_tflops, step_seconds)
        if mfu is not None:
            result["mfu"] = mfu
        return result


def engine_reservation(cfg: Any, device: str, device_memory: int | None) -> tuple[int, bool]:
    """(bytes the engine keeps beside the trainer, whether it gives them back between generations)."""
    generation = cfg.get("generation") or {}
    if generation.get("name", "hf") != "vllm":  # hf samples with the trainer's weights; a server is elsewhere
        return 0, False
    if device == "cuda":
        from rlhf_lab.generation.vllm import GPU_MEMORY_UTILIZATION, sleeps

        fraction = float(generation.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION))
        return int(fraction * (device_memory or 0)), sleeps(generation, torch.device("cuda"))
    return int(generation.get("kv_cache_mib", 512)) << 20, False


def table(plan: DevicePlan, peak_tflops: float | None, step_seconds: float | None) -> str:
    """The plan as a table (GiB per phase, the peak, the fit, FLOPs and MFU)."""
    phases = plan.phases()
    lines = [f"plan: one step on {plan.world_size} × {plan.device}"
             f"{' (fsdp)' if plan.sharded else ''}, {plan.step.rows} rows × {plan.step.sequence_tokens} tokens per "
             "rank", f"{'phase':<22}{'GiB':>10}"]
    labels = {"weights": "weights", "reference": "reference", "optimizer": "optimizer (AdamW)",
              "kv_cache": "generation KV cache", "generation": "generation peak", "scoring": "scoring pass peak",
              "training": "training pass peak", "engine_reservation": "engine reservation"}
    lines += [f"{labels[name]:<22}{value / GIB:>10.3f}" for name, value in phases.items()]
    memory = "unknown" if plan.device_memory is None else f"{plan.device_memory / GIB:.3f}"
    verdict = {None: "", True: "fits", False: "does NOT fit"}[plan.fits]
    lines.append(f"{'peak':<22}{plan.peak / GIB:>10.3f}   of {memory} GiB: {verdict}".rstrip())
    lines.append(f"{'FLOPs per step':<22}{plan.step.flops_per_step:>10.3e}   "
                 + ", ".join(f"{name} {value:.2e}" for name, value in plan.step.flops.items()))
    if peak_tflops:
        seconds = plan.step.flops_per_step / (peak_tflops * 1e12)
        lines.append(f"{'at peak throughput':<22}{seconds:>10.3f} s   ({peak_tflops:g} TFLOP/s, MFU 100%)")
    mfu = plan.mfu(peak_tflops, step_seconds)
    if mfu is not None:
        lines.append(f"{'MFU':<22}{mfu:>10.1%}   at {step_seconds:g} s per step")
    versions = environment(plan.device, plan.step.attention)
    lines.append(f"planned with torch {versions['torch']}, transformers {versions['transformers']}, "
                 f"{versions['attention']} attention, for {versions['device']}")
    return "\n".join(lines)


def json_line(plan: DevicePlan, peak_tflops: float | None, step_seconds: float | None) -> str:
    return json.dumps(plan.summary(peak_tflops, step_seconds))
