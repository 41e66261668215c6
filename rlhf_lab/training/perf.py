"""Every step's ``perf/*`` metrics: peak memory, tokens per second, and the MFU the planner's FLOP count implies.

- ``perf/peak_memory_gib``: the CUDA allocator's peak (``torch.cuda.max_memory_allocated``) on a GPU; the process's
  peak resident memory (``ru_maxrss``) on a CPU.
- ``perf/tokens_per_s``: sampled (generated) plus trained (through the training pass, every epoch) tokens over the
  step's time.
- ``perf/mfu``: the step's FLOPs over its time and the device's peak (``trainer.peak_tflops``, else a GPU's by its
  name; not logged where neither is known). The FLOPs are :mod:`rlhf_lab.planner`'s count of a small step of the
  run's config on fake tensors, per sampled and per trained token, times the step's tokens; counted once, at the
  first step that needs them.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

GIB = 1 << 30
PROBE_TOKENS = 8  # prompt and response tokens of the small step whose FLOPs are counted


def peak_memory_gib(device: torch.device) -> float:
    """The device allocator's peak on CUDA, the process's peak resident memory otherwise (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes / GIB if sys.platform == "darwin" else kib_or_bytes * 1024 / GIB


def device_peak_tflops(cfg: Any, device: torch.device) -> float | None:
    """``trainer.peak_tflops``, else the GPU's dense bf16 peak by its name; None where unknown."""
    if cfg.trainer.get("peak_tflops"):
        return float(cfg.trainer.peak_tflops)
    if device.type == "cuda":
        from rlhf_lab.planner.report import peak_tflops_of

        return peak_tflops_of(torch.cuda.get_device_name(device))
    return None


class StepPerformance:
    """The ``perf/*`` metrics of a run's steps (see the module's docstring)."""

    def __init__(self, cfg: Any, tokenizer: Any, precision: Any, device: torch.device) -> None:
        self.cfg, self.tokenizer, self.precision, self.device = cfg, tokenizer, precision, device
        self.peak_tflops = device_peak_tflops(cfg, device)
        self._per_token: tuple[float, float] | None = None

    def flops_per_token(self) -> tuple[float, float]:
        """(FLOPs per sampled token, per trained token) of the run's step, from the planner's count."""
        if self._per_token is None:
            import copy

            from omegaconf import open_dict

            from rlhf_lab.planner.step import plan_step

            probe = copy.deepcopy(self.cfg)
            with open_dict(probe):
                probe.trainer.prompts_per_step = 1  # one group (an algorithm may need several samples per prompt)
                probe.trainer.max_new_tokens = min(probe.trainer.max_new_tokens, PROBE_TOKENS)
                probe.algorithm.mini_batch_size = 0
            plan = plan_step(probe, self.tokenizer, self.precision, prompt_tokens=PROBE_TOKENS)
            sampled = plan.flops["generation"] / max(plan.tokens["sampled"], 1)
            trained = (plan.flops["scoring"] + plan.flops["training"]) / max(plan.tokens["trained"], 1)
            self._per_token = (sampled, trained)
        return self._per_token

    def metrics(self, seconds: float, sampled_tokens: int, trained_tokens: int) -> dict[str, float]:
        """This step's ``perf/*`` values (tokens of every rank; the FLOPs of every rank over every rank's peak)."""
        from rlhf_lab.runtime import distributed

        values = {"perf/peak_memory_gib": peak_memory_gib(self.device),
                  "perf/tokens_per_s": (sampled_tokens + trained_tokens) / seconds}
        if self.peak_tflops:
            per_sampled, per_trained = self.flops_per_token()
            flops = per_sampled * sampled_tokens + per_trained * trained_tokens
            values["perf/mfu"] = flops / (seconds * self.peak_tflops * 1e12 * distributed.world_size())
        return values
