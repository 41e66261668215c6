"""The child process of ``rlhf-lab bench``: one framework trains one job and writes its records as JSON.

``python -m benchmarks.bench --worker JOB RESULT`` runs :func:`worker`: W warm-up plus N measured steps of
rlhf_lab's Trainer (:func:`run_rlhf_lab`) or of TRL's GRPOTrainer (:mod:`benchmarks.bench_trl`), then its
per-step records, its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``, so model loading counts too), its setup time
and, for rlhf_lab, the hardware profile it ran under.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_format import PHASES


@dataclass
class Job:
    """One child run: ``framework`` trains ``overrides`` for ``warmup + steps`` steps."""

    row: str
    framework: str
    overrides: list[str]
    steps: int
    warmup: int


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024

def run_rlhf_lab(cfg: Any, steps: int, warmup: int, work_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train ``warmup + steps`` steps with rlhf_lab's Trainer; (per-step records, facts about the run)."""
    import rlhf_lab.components  # noqa: F401  (registers the built-in parts)
    from benchmarks.bench_floor import ModelShape, floor_seconds, measure_floor, record_generation_work
    from rlhf_lab.hardware import describe
    from rlhf_lab.runtime import distributed
    from rlhf_lab.runtime.versions import environment
    from rlhf_lab.step.compute import attention_implementation
    from rlhf_lab.training.loop import Trainer
    from rlhf_lab.training.records import synchronize

    trainer = Trainer(cfg, work_dir / "run")
    ready = time.perf_counter()
    works = record_generation_work(trainer)
    shape = ModelShape.of(distributed.unwrap(trainer.policy))
    # The floor is this CPU's measured bandwidth and matrix rate: it says nothing of a GPU's generation.
    floor = measure_floor(trainer.precision.name) if trainer.device.type == "cpu" else None
    weight_bytes = 2 if trainer.precision.name != "fp32" else 4  # autocast reads its cached half copies
    records = []
    try:
        for step in range(warmup + steps):
            works.clear()
            synchronize()
            start = time.perf_counter()
            metrics = trainer.train_step(step)
            synchronize()
            step_s = time.perf_counter() - start
            records.append({
                "step_s": step_s,
                "phases": {name: metrics.get(f"time/{name}_s", 0.0) for name in PHASES},
                "sync_check_s": metrics.get("time/sync_check_s", 0.0),  # the weight-sync canary, inside generate
                "tokens": round(metrics["throughput/tokens_per_s"] * metrics["time/step_s"]),
                "reward_mean": metrics["reward/mean"],
                "mfu": metrics.get("perf/mfu"),  # logged where the device's peak is known (a GPU by its name)
                "generation_floor": (floor_seconds(works[0], shape, floor, weight_bytes)
                                     if floor is not None and len(works) == 1 else None),
            })
    finally:
        trainer.records.close()
    return records, {"trainer": "rlhf_lab.Trainer", "device": str(trainer.device), "ready_at": ready,
                     "floor": asdict(floor) if floor else None, "model_shape": asdict(shape), "hardware": describe(trainer.hardware),
                     "process_switches": process_switches(),
                     "versions": environment(trainer.device.type, attention_implementation(trainer.policy))}

def process_switches() -> dict[str, str | None]:
    """The environment switches a CPU profile may set, as this process has them (the user's, or the profile's)."""
    from rlhf_lab.hardware.allocator import USER_SWITCHES

    return {name: os.environ.get(name) for name in (*USER_SWITCHES, "GLIBC_TUNABLES")}


def worker(job_path: str, result_path: str) -> None:
    """Child process: run one job, write {records, peak_rss_mib, setup_s, ...} to ``result_path``."""
    started = time.perf_counter()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    job = Job(**json.loads(Path(job_path).read_text()))
    from rlhf_lab.config import compose

    cfg = compose(job.overrides)
    with tempfile.TemporaryDirectory(prefix=f"rlhf_lab_bench_{job.framework}_") as tmp:
        if job.framework == "trl":
            from benchmarks.bench_trl import run_trl

            records, facts = run_trl(cfg, job.steps, job.warmup, Path(tmp))
        else:
            records, facts = run_rlhf_lab(cfg, job.steps, job.warmup, Path(tmp))
    import torch

    ready_at = facts.pop("ready_at", None)
    result = {
        "records": records[job.warmup :],
        "warmup_records": records[: job.warmup],
        "peak_rss_mib": _peak_rss_mib(),
        "setup_s": (ready_at - started) if ready_at else None,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None,
        "torch_threads": torch.get_num_threads(),
        **facts,
    }
    Path(result_path).write_text(json.dumps(_clean(result)))

def _clean(value: Any) -> Any:
    """NaN/inf become None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
