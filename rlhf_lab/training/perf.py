"""Every step's ``perf/*`` metrics: peak memory, tokens per second, and the MFU the planner's FLOP count implies.

- ``perf/peak_memory_gib``: the CUDA allocator's peak during the step (``torch.cuda.max_memory_allocated``, reset as
  the step starts) on a GPU; the process's peak resident memory so far (``ru_maxrss``, which no call resets) on a CPU.
- ``perf/peak_memory_gib/generation``, ``perf/peak_memory_gib/scoring``, ``perf/peak_memory_gib/training`` (a GPU
  only): the peak of each of the plan's phases (``rlhf-lab plan``), the allocator's peak reset at every phase
  boundary of the step (:class:`~rlhf_lab.runtime.timer.StepTimer`): generation is the decode, scoring the reward,
  the scoring pass, the exact KL and the advantages, training the update's passes and the optimizer's step.
- ``perf/tokens_per_s``: sampled (generated) plus trained (through the training pass, every epoch) tokens over the
  step's time.
- ``perf/mfu``: the step's FLOPs over its time and the device's peak (``trainer.peak_tflops``, else a GPU's by its
  name; not logged where neither is known). The FLOPs are :mod:`rlhf_lab.planner`'s count of one prompt group of
  the run's step on fake tensors, at the first step's prompt length and ``trainer.max_new_tokens`` (the split of
  prompt and response tokens decides what a token costs: a group's prompt is computed once, the LM head runs on
  response tokens only), per sampled and per trained token, times each step's tokens; counted once, at the first
  step that needs them (fake tensors: a few seconds whatever the model's size).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from rlhf_lab.runtime.timer import CudaPeak, StepTimer

GIB = 1 << 30
# The plan's phases (rlhf_lab.planner) by the step's timed phases (StepTimer's names).
PLAN_PHASES = {"generation": ("generate", "generate_greedy"),
               "scoring": ("reward", "policy_logprobs", "reference", "kl", "advantages"),
               "training": ("policy_forward_backward", "optimizer")}


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

    def timer(self) -> StepTimer:
        """A step's timer: on a GPU it keeps each phase's peak memory too."""
        return StepTimer(CudaPeak(self.device) if self.device.type == "cuda" else None)

    def step_started(self) -> None:
        """A step begins: the CUDA allocator's peak counts from here (the step's own)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def flops_per_token(self, prompt_tokens: int | None = None) -> tuple[float, float]:
        """(FLOPs per sampled token, per trained token) of the run's step at ``prompt_tokens`` per prompt (default
        ``data.max_prompt_tokens``; fixed by the first call), from the planner's count."""
        if self._per_token is None:
            import copy

            from omegaconf import open_dict

            from rlhf_lab.planner.step import plan_step

            probe = copy.deepcopy(self.cfg)
            with open_dict(probe):
                probe.trainer.prompts_per_step = 1  # one group (an algorithm may need several samples per prompt)
                probe.algorithm.mini_batch_size = 0
            plan = plan_step(probe, self.tokenizer, self.precision, prompt_tokens=prompt_tokens)
            sampled = plan.flops["generation"] / max(plan.tokens["sampled"], 1)
            trained = (plan.flops["scoring"] + plan.flops["training"]) / max(plan.tokens["trained"], 1)
            self._per_token = (sampled, trained)
        return self._per_token

    def metrics(self, seconds: float, sampled_tokens: int, trained_tokens: int,
                prompt_tokens: int | None = None, timer: StepTimer | None = None) -> dict[str, float]:
        """This step's ``perf/*`` values (tokens of every rank; the FLOPs of every rank over every rank's peak);
        ``prompt_tokens``: the step's prompt length (the FLOPs' count is taken at the first step's); ``timer``: the
        step's (:meth:`timer`), whose phases' peaks give the per-phase values on a GPU."""
        from rlhf_lab.runtime import distributed

        values = {"perf/peak_memory_gib": peak_memory_gib(self.device),
                  "perf/tokens_per_s": (sampled_tokens + trained_tokens) / seconds}
        if timer is not None and timer.memory is not None:  # the phases reset the allocator's peak: theirs counts
            values["perf/peak_memory_gib"] = timer.step_peak() / GIB
            for phase, names in PLAN_PHASES.items():
                peaks = [timer.peaks[name] for name in names if name in timer.peaks]
                if peaks:
                    values[f"perf/peak_memory_gib/{phase}"] = max(peaks) / GIB
        if self.peak_tflops:
            per_sampled, per_trained = self.flops_per_token(prompt_tokens)
            flops = per_sampled * sampled_tokens + per_trained * trained_tokens
            values["perf/mfu"] = flops / (seconds * self.peak_tflops * 1e12 * distributed.world_size())
        return values
