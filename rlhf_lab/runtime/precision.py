"""Numeric precision of a run, with Lightning's names (``trainer.precision``).

- ``auto`` (the default): ``bf16-mixed`` where the device multiplies bfloat16 matrices fast (a CUDA GPU with
  bfloat16 support; a CPU with AVX512-BF16 or AMX whose bfloat16 products, measured once per machine, are at
  least as fast as its float32 ones), else ``fp32`` (:func:`fast_bf16`): bfloat16 without native support is
  emulated, and some CPUs with the instructions still multiply bfloat16 slower than float32;
- ``fp32``: float32 weights, float32 compute;
- ``bf16-mixed``: float32 master weights and optimizer state; forward passes (generation, reference,
  training) under ``torch.autocast(dtype=bfloat16)``; gradients land in float32;
- ``bf16-true``: the weights themselves in bfloat16 (the former ``trainer.dtype=bfloat16``);
- ``fp16-mixed``: float32 master weights, float16 autocast, and a gradient scaler against underflow
  (CUDA only: float16 autocast with a scaler is a GPU recipe).

``trainer.dtype`` is the former key: ``float32`` maps to ``fp32`` and ``bfloat16`` to ``bf16-true`` with a
deprecation line; ``float16`` (pure fp16 weights) has no safe equivalent and is refused with a pointer.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_lab.errors import ConfigError
from rlhf_lab.runtime.cache import cache_dir
from rlhf_lab.runtime.files import write_json_atomic
from rlhf_lab.runtime.versions import cpu_name

PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16-true", "fp16-mixed")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16-true"}  # trainer.dtype -> trainer.precision
WEIGHT_DTYPES = {"fp32": "float32", "bf16-mixed": "float32", "bf16-true": "bfloat16", "fp16-mixed": "float32"}
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def fast_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices fast (what ``trainer.precision=auto`` asks): a CUDA GPU
    with bfloat16 support; a CPU with AVX512-BF16 or AMX where :func:`bf16_products_pay`."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        native = any(probe() for probe in probes if probe is not None)
    except RuntimeError:  # a build without the CPU capability probes
        return False
    return native and bf16_products_pay(torch.get_num_threads())


PROBE_SHAPE = (512, 1024, 1024)  # rows x inputs x outputs: a training pass's product of a small model's layer
PRODUCTS_FILE = "cpu_products.json"  # the answers, in rlhf_lab's cache folder


@cache
def bf16_products_pay(threads: int) -> bool:
    """Whether this CPU multiplies bfloat16 matrices at least as fast as float32 ones with ``threads`` threads.

    Having AVX512-BF16 is not enough: some CPUs with it multiply bfloat16 slower than float32 (the docs'
    benchmark history has an Intel Xeon without AMX at about half float32's speed). Measured once per machine (:func:`measure_bf16_products`) and kept
    in ``<rlhf_lab cache>/cpu_products.json`` under the CPU's name and vector unit, torch's version and ``threads``,
    so every later run there (each job of a sweep, each rank) reads the same answer; where the file cannot be
    written the answer is measured once per process. Delete the file to measure again."""
    path, key = cache_dir() / PRODUCTS_FILE, _cpu_key(threads)
    known = _read_answers(path)
    if isinstance(known.get(key), bool):
        return known[key]
    answer = measure_bf16_products()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**_read_answers(path), key: answer})
    except OSError:
        return answer
    written = _read_answers(path).get(key)  # two processes measuring at once: the one written last is the answer
    return written if isinstance(written, bool) else answer


def _read_answers(path: Path) -> dict[str, Any]:
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return answers if isinstance(answers, dict) else {}


def _cpu_key(threads: int) -> str:
    """The answers file's key: the CPU's name and the vector unit torch uses, torch's version, the thread count."""
    return (f"{cpu_name()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{threads} threads")


def measure_bf16_products() -> bool:
    """One product of :data:`PROBE_SHAPE` in each dtype, the best of five after a warm-up (~0.2 s): whether the
    bfloat16 one is at least as fast. The global random generator is not touched."""
    rows, inputs, outputs = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    best = {}
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, inputs, generator=generator).to(dtype)
            weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
            times = []
            for _ in range(6):
                start = time.perf_counter()
                torch.nn.functional.linear(x, weight)
                times.append(time.perf_counter() - start)
            best[dtype] = min(times[1:])
    return best[torch.bfloat16] <= best[torch.float32]


def resolve_precision(precision: str, dtype: str | None, warn: bool = True,
                      device: torch.device | None = None, agree: Callable[[bool], bool] | None = None) -> str:
    """The precision a run uses, from ``trainer.precision`` and the deprecated ``trainer.dtype``; ``auto``
    resolves for ``device`` (the CPU when None). On a CPU, where ``auto``'s answer is measured, ``agree`` (called
    on every rank alike: true where every rank's is) makes the ranks of one run pick the same."""
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision!r} is not valid; choose from: {', '.join(PRECISIONS)}")
    if dtype is None:
        if precision == "auto":
            device = device or torch.device("cpu")
            fast = fast_bf16(device)
            if agree is not None and device.type == "cpu":
                fast = agree(fast)
            return "bf16-mixed" if fast else "fp32"
        return precision
    if dtype == "float16":
        raise ConfigError("trainer.dtype=float16 (pure float16 weights) is replaced by trainer.precision=fp16-mixed "
                          "(float32 master weights, float16 autocast, gradient scaling; CUDA only)")
    if dtype not in DTYPE_ALIASES:
        raise ConfigError(f"trainer.dtype={dtype!r} is not valid; choose from: float32, bfloat16, float16")
    mapped = DTYPE_ALIASES[dtype]
    if precision not in ("auto", "fp32") and precision != mapped:
        raise ConfigError(f"trainer.dtype={dtype} (= trainer.precision={mapped}) contradicts "
                          f"trainer.precision={precision}; set trainer.precision only")
    if warn:
        print(f"trainer.dtype is deprecated: trainer.dtype={dtype} means trainer.precision={mapped}; use that",
              file=sys.stderr)
    return mapped


def check_device(precision: str, device: torch.device) -> None:
    """fp16-mixed needs CUDA (a gradient scaler over float16 autocast)."""
    if precision == "fp16-mixed" and device.type != "cuda":
        raise ConfigError(f"trainer.precision=fp16-mixed needs a CUDA device (got trainer.device={device.type}); "
                          "on a CPU use trainer.precision=bf16-mixed")


@dataclass
class Precision:
    """How a run's forward passes and weights are typed; ``autocast()`` wraps every forward pass."""

    name: str
    device_type: str

    @classmethod
    def from_config(cls, trainer: Any, device: torch.device, warn: bool = True,
                    agree: Callable[[bool], bool] | None = None) -> Precision:
        name = resolve_precision(trainer.precision, trainer.dtype, warn=warn, device=device, agree=agree)
        check_device(name, device)
        return cls(name, device.type)

    @property
    def weights_dtype(self) -> str:
        """The dtype name the model's parameters are stored in."""
        return WEIGHT_DTYPES[self.name]

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype forward passes compute in under a mixed precision (bfloat16, float16); None otherwise."""
        return AUTOCAST_DTYPES.get(self.name)

    @property
    def autocasts(self) -> bool:
        """Whether forward passes run under autocast (the ``*-mixed`` precisions)."""
        return self.name in AUTOCAST_DTYPES

    def autocast(self) -> AbstractContextManager:
        dtype = AUTOCAST_DTYPES.get(self.name)
        return torch.autocast(self.device_type, dtype=dtype) if dtype is not None else nullcontext()

    def store_frozen_weights(self, module: nn.Module) -> int:
        """Under a mixed precision, keep the frozen ``nn.Linear`` weights of ``module`` in the autocast dtype.

        Autocast caches its half-precision copy of a weight only for trainable leaves; a frozen one (the
        reference copy, LoRA's base layers) is cast again at every call, at every decode step. Stored in
        the autocast dtype, the matrix product sees the same numbers with no cast, in half the memory.
        Weights tied to an embedding stay as they are (the lookup feeds the float32 residual stream).
        Returns the number of layers stored; nothing changes outside ``*-mixed``.
        """
        dtype = AUTOCAST_DTYPES.get(self.name)
        if dtype is None:
            return 0
        tied = {id(layer.weight) for layer in module.modules() if isinstance(layer, nn.Embedding)}
        stored = 0
        for layer in module.modules():
            if (isinstance(layer, nn.Linear) and id(layer.weight) not in tied
                    and not any(p.requires_grad for p in layer.parameters(recurse=False))):
                layer.to(dtype)
                stored += 1
        return stored

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for float16 autocast (None otherwise)."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16-mixed" else None
