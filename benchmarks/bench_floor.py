"""The machine's floor for the generation phase, measured on the spot, and the work one generation does.

A generation phase cannot beat either bound:

- memory: every forward call reads every weight matrix once, so ``weight bytes × forward calls / bandwidth``
  (one call for the shared prompt prefill plus one per decode step);
- compute: ``FLOPs / FLOP rate`` with FLOPs = 2 × (weight-matrix parameters) × (tokens through the network:
  each distinct prompt once, then every row's decode tokens), attention's score/value products added.

``bandwidth`` is a streaming copy (read + write) of a buffer far larger than the caches; the FLOP rate is a
large square matrix product in the dtype the forward passes compute in (float32, or bfloat16 under
``bf16-mixed``/``bf16-true``). Both are the best of a few repetitions, as a roofline's peaks are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                  "fp16-mixed": torch.float16}


def _best_seconds(run: Callable[[], Any], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second moved by a streaming copy (each byte read once and written once)."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    target = torch.empty_like(source)
    seconds = _best_seconds(lambda: target.copy_(source), repeats)
    return 2 * source.numel() * source.element_size() / seconds


def matmul_flop_rate(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP per second of a ``size``³ matrix product in ``dtype`` (2·n³ FLOP)."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(dtype)
    right = torch.randn(size, size, generator=generator).to(dtype)
    return 2 * size**3 / _best_seconds(lambda: left @ right, repeats)


@dataclass
class Floor:
    bandwidth_bytes_per_s: float
    flop_rate: float
    compute_dtype: str


def measure_floor(precision: str) -> Floor:
    dtype = COMPUTE_DTYPES.get(precision, torch.float32)
    return Floor(memory_bandwidth(), matmul_flop_rate(dtype), str(dtype).removeprefix("torch."))


@dataclass
class ModelShape:
    """What a forward pass costs per token: the weight matrices it multiplies by (the LM head included,
    the embedding table only gathered from) and the attention geometry."""

    matrix_parameters: int
    layers: int
    hidden_size: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        config = model.config
        matrices = sum(module.weight.numel() for module in model.modules()
                       if isinstance(module, nn.Linear) and module.weight.dim() == 2)
        return cls(matrices, config.num_hidden_layers, config.hidden_size)


@dataclass
class GenerationWork:
    """One generation phase: its rows, the prompt tokens prefilled, and the decode steps taken."""

    rows: int
    prefill_tokens: int  # tokens of the distinct prompts that went through the network
    prompt_width: int
    decode_steps: int

    def flops(self, shape: ModelShape) -> float:
        """2·params per token for the matrices, plus 4·layers·hidden per (query, key) pair for attention."""
        decode_tokens = self.rows * self.decode_steps
        matrices = 2 * shape.matrix_parameters * (self.prefill_tokens + decode_tokens)
        # Each decode token attends to the prompt and the tokens before it; the prefill is causal.
        pairs = self.rows * sum(self.prompt_width + step for step in range(self.decode_steps))
        pairs += self.prefill_tokens * self.prompt_width // 2
        return matrices + 4 * shape.layers * shape.hidden_size * pairs

    def weight_reads(self) -> int:
        """Forward calls, each reading every weight matrix once: the prefill and each decode step."""
        return 1 + self.decode_steps


def floor_seconds(work: GenerationWork, shape: ModelShape, floor: Floor, weight_bytes_per_parameter: int) -> dict:
    """The bound on one generation phase: the larger of the memory and the compute bound, with both."""
    memory_s = shape.matrix_parameters * weight_bytes_per_parameter * work.weight_reads() / floor.bandwidth_bytes_per_s
    compute_s = work.flops(shape) / floor.flop_rate
    return {"memory_s": memory_s, "compute_s": compute_s, "floor_s": max(memory_s, compute_s),
            **asdict(work)}


def record_generation_work(trainer: Any) -> list[Any]:
    """Wrap the trainer's sampling call so each step's generation shape (rows, prompt tokens prefilled,
    decode steps) is known to the floor calculation; the list is filled as the step runs."""
    works: list[GenerationWork] = []
    maker = trainer.experience
    sample = maker.generate

    def generate(prompts: list[str], group_size: int, rng_keys: Any) -> Any:
        rollout = sample(prompts, group_size, rng_keys)
        distinct = len(prompts) if group_size > 1 else rollout.batch_size  # prompts prefilled once per group
        works.append(GenerationWork(rows=rollout.batch_size, prefill_tokens=distinct * rollout.prompt_width,
                                    prompt_width=rollout.prompt_width, decode_steps=rollout.response_mask.shape[1]))
        return rollout

    maker.generate = generate
    return works


def generation_floor_summary(floors: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """Mean generation phase against its floor over the measured steps (rlhf_lab runs; none for TRL)."""
    if not floors:
        return {}
    generate_s = statistics.fmean(seconds for seconds, _ in floors)
    floor_s = statistics.fmean(floor["floor_s"] for _, floor in floors)
    return {"generation_floor_s_mean": floor_s, "generation_over_floor": generate_s / floor_s,
            "generation_floor_bound": "memory" if floors[0][1]["memory_s"] >= floors[0][1]["compute_s"] else "compute"}
