"""GPU checks (``make test-gpu``, which stops non-zero on a machine without CUDA before any of these is collected).
In-process random-init models only (a GPU machine may have no network and no embedded model): the tiny Llama (its
tokenizer from ``make gpu-bundle``'s cache) and a ~1B one.

- the NCCL collectives of every reduction take the tensors where NCCL wants them (a group of one rank);
- a 1-GPU ``torchrun`` run under DDP (its NCCL collectives run), bf16-mixed, and FSDP2 on one rank; two FSDP2
  ranks where the machine has two GPUs;
- the step timer's phases cover their kernels (they synchronise);
- the rollout worker's order on CUDA tensors (the stand-in vLLM engine sleeping and waking, ``empty_cache`` before
  each wake, the weight-sync canary every step);
- memory after ``Trainer.__init__`` for a ~1B Llama under FSDP2 and bf16-mixed, printed with the figures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.limits import HANG_GUARD_S

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device (make test-gpu stops before this)")]

TINY = ["model=tiny", "trainer.steps=2", "trainer.prompts_per_step=2", "algorithm.group_size=2",
        "trainer.max_new_tokens=8", "trainer.eval_prompts=2", "trainer.progress_bar=false", "reward=length",
        "trainer.device=cuda", "trainer.seed_per_prompt=true"]


@pytest.fixture(autouse=True)
def free_device():
    """Each test starts with the device as empty as the last one left it after Python's cyclic collector: an
    in-process trainer can sit in a reference cycle (rlhf_lab.training.launch.release_memory), and its weights
    would count in the next test's peak."""
    from rlhf_lab.training.launch import release_memory

    release_memory()
    yield
    release_memory()


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    return env


def run(tmp_path: Path, *overrides: str, processes: int = 1) -> list[dict]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                "-m", "rlhf_lab"]
    result = subprocess.run([*launcher, *TINY, *overrides, f"trainer.output_dir={tmp_path / 'run'}"],
                            capture_output=True, text=True, timeout=HANG_GUARD_S, env=environment())
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_every_reduction_runs_on_nccl(tmp_path: Path) -> None:
    import torch.distributed as dist

    from rlhf_lab import masked
    from rlhf_lab.runtime import distributed

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        values, mask = torch.ones(2, 3), torch.ones(2, 3)  # CPU tensors: the helpers move them
        assert distributed.collective_device() == torch.device("cuda", 0)
        assert torch.equal(distributed.all_reduce_sum(values), values)
        assert distributed.all_reduce_flags(True) and distributed.any_rank(True)
        assert distributed.sum_dict({"loss": 2.0}) == {"loss": 2.0}
        assert torch.equal(distributed.gather_rows(values), values)
        assert distributed.maximum(torch.tensor(3.0)) == 3.0 and distributed.minimum(torch.tensor(3.0)) == 3.0
        assert float(masked.masked_mean(values, mask, across_ranks=True)) == 1.0
        assert distributed.gather_objects(["a"]) == ["a"]
        distributed.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_one_gpu_torchrun_run_trains_in_bf16_mixed(tmp_path: Path, strategy: str) -> None:
    lines = run(tmp_path, f"trainer.strategy={strategy}", "trainer.precision=bf16-mixed")
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in steps] == [0, 1]
    # One update per rollout: the training pass's own log-probs are π_old (no rescoring pass, no sampler gap logged).
    assert all(line["time/step_s"] > 0 and math.isfinite(line["loss/total"]) for line in steps)
    assert (tmp_path / "run" / "checkpoints" / "step_2" / ("sharded" if strategy == "fsdp" else "model")).is_dir()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU here: two FSDP2 ranks need two GPUs")
def test_two_fsdp_ranks_train_in_bf16_mixed(tmp_path: Path) -> None:
    lines = run(tmp_path, "trainer.strategy=fsdp", "trainer.precision=bf16-mixed", processes=2)
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in steps] == [0, 1] and all(math.isfinite(line["loss/total"]) for line in steps)
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "sharded").is_dir()


def test_the_rollout_worker_s_order_holds_on_cuda(tmp_path: Path, monkeypatch) -> None:
    """The trainer on CUDA with the stand-in vLLM (tests/fake_vllm.py) sleeping at level 2 between generations:
    every wake empties the cache first, every step's samples come from the synced weights. The GPU machine has no
    vLLM (its GPU wheels cannot reach it): the stand-in is what ``import vllm`` finds."""
    from rlhf_lab.config import compose
    from rlhf_lab.training.loop import Trainer
    from tests import fake_vllm

    fake_vllm.install(monkeypatch)
    emptied = []
    real_empty_cache = torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (emptied.append(1), real_empty_cache()))
    fake_vllm.LLM.built = []
    cfg = compose([*TINY, "generation=vllm", "generation.sleep=true", "trainer.precision=fp32", "trainer.lr=1e-2",
                   "trainer.steps=3", f"trainer.output_dir={tmp_path / 'run'}"])
    Trainer(cfg, tmp_path / "run").train()
    llm = fake_vllm.LLM.built[0]
    wakes = [call for call in llm.calls if call.startswith("wake_up")]
    assert wakes and len(emptied) >= len(wakes)  # before each wake (the order: tests/unit/test_rollout_worker.py)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["rollout/weight_version"] for line in steps] == [0, 1, 2]
    assert all(line["rollout/weight_sync_diff"] < 1e-3 for line in steps[1:])


def test_the_step_timer_covers_its_kernels() -> None:
    from rlhf_lab.runtime.timer import StepTimer

    timer = StepTimer()
    x = torch.randn(4096, 4096, device="cuda")
    with timer.phase("matmul"):
        for _ in range(20):
            x = x @ x / 4096
    queued_only = StepTimer()
    with queued_only.phase("launch"):
        pass
    assert timer.times["matmul"] > 10 * queued_only.times["launch"]


def test_memory_after_init_of_a_1b_llama_under_fsdp(tmp_path: Path) -> None:
    """A ~1B random-init Llama (16 layers × 2048): the policy's float32 shards, the reference's shards, nothing
    whole per rank. Prints the figures for the benchmark page."""
    from rlhf_lab.config import compose
    from rlhf_lab.runtime import distributed
    from rlhf_lab.training.loop import Trainer

    dims = ["model.tiny.hidden_size=2048", "model.tiny.num_hidden_layers=16", "model.tiny.num_attention_heads=16",
            "model.tiny.num_key_value_heads=8", "model.tiny.intermediate_size=5632"]
    cfg = compose([*TINY, *dims, "trainer.strategy=fsdp", "trainer.precision=bf16-mixed",
                   f"trainer.output_dir={tmp_path / 'run'}"])
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer = Trainer(cfg, tmp_path / "run")
        parameters = sum(p.numel() for p in trainer.models.policy.parameters())
        allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        print(f"1B-class Llama: {parameters / 1e9:.2f} B parameters; after Trainer.__init__ {allocated / 2**30:.2f} "
              f"GiB allocated, peak {peak / 2**30:.2f} GiB")
        # One rank holds everything here: policy (fp32) + reference (fp32 shards) + AdamW state made lazily.
        assert allocated < parameters * 4 * 2.2
    finally:
        distributed.teardown()


def warmed_baseline() -> int:
    """The bytes this process holds on the GPU before a measured run starts, after what can be freed is freed: earlier
    tests' cached blocks and cuBLAS's workspaces (on sm90 each (handle, stream) keeps 32 MiB in the caching
    allocator, which ``empty_cache`` does not free). A measurement subtracts it: what CUDA and earlier tests keep is
    not the step's, and no absolute guard on it can hold across devices."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def versions() -> str:
    """The versions and attention code a GPU figure was measured with (a plan calibrated with other versions does
    not hold: transformers 5.17's SDPA path copies K and V where 5.23's does not)."""
    from rlhf_lab.runtime.versions import environment

    facts = environment("cuda", None)
    return (f"torch {facts['torch']}, transformers {facts['transformers']}, {facts['device']}, "
            f"capability {'.'.join(map(str, torch.cuda.get_device_capability()))}")


def test_a_1b_step_s_peak_memory_is_the_plan_s(tmp_path: Path) -> None:
    """The peak GPU memory during a full step of a ~1B random-init Llama in bf16-mixed at the CUDA defaults
    (gradient checkpointing, chunked log-probs, a micro-batch token budget; given here as the values null resolves
    to on CUDA) — ``torch.cuda.max_memory_allocated`` over the second step, whose optimizer state exists, and over
    each of its phases (generation, scoring, training: the peak reset at every boundary) — against ``rlhf-lab
    plan``'s prediction of the same step and phases on fake tensors, within the planner's stated 15% each."""
    from rlhf_lab.config import compose
    from rlhf_lab.planner.calibration import prompt_widths
    from rlhf_lab.planner.step import plan_step
    from rlhf_lab.runtime import distributed
    from rlhf_lab.training.loop import Trainer

    dims = ["model.tiny.hidden_size=2048", "model.tiny.num_hidden_layers=16", "model.tiny.num_attention_heads=16",
            "model.tiny.num_key_value_heads=8", "model.tiny.intermediate_size=5632"]
    defaults = ["trainer.gradient_checkpointing=true", "trainer.chunked_logprobs=true",
                "trainer.max_tokens_per_micro_batch=16384"]
    cfg = compose([*TINY, *dims, *defaults, "trainer.precision=bf16-mixed", "trainer.eval_prompts=0",
                   "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.max_new_tokens=64",
                   f"trainer.output_dir={tmp_path / 'run'}"])
    baseline = warmed_baseline()  # what the process holds before the trainer: not the step's, taken off the peak
    try:
        trainer = Trainer(cfg, tmp_path / "run")
        trainer.train_step(0)
        snapshot = os.environ.get("RLHF_LAB_GPU_SNAPSHOT")  # benchmarks/gpu_check.sh: where the peak's bytes come from
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()  # the states the step starts with (the plan counts them apart)
        with prompt_widths(trainer) as widths:
            metrics = trainer.train_step(1)
        torch.cuda.synchronize()
        # The step's timer resets the allocator's peak at each phase boundary: the step's and each phase's peaks are
        # its perf/ metrics (rlhf_lab/training/perf.py), the baseline taken off each.
        measured = round(metrics["perf/peak_memory_gib"] * 2**30) - baseline
        phases = {phase: round(metrics[f"perf/peak_memory_gib/{phase}"] * 2**30) - baseline
                  for phase in ("generation", "scoring", "training") if f"perf/peak_memory_gib/{phase}" in metrics}
        if snapshot:
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        plan = plan_step(cfg, trainer.tokenizer, trainer.precision, prompt_tokens=widths[0], count_flops=False)
        states = plan.weights + plan.reference + plan.optimizer
        print(f"1B-class Llama step: measured peak {measured / 2**30:.2f} GiB, planned {plan.peak / 2**30:.2f} GiB "
              f"({plan.peak_phase}); phases {({k: round(v / 2**30, 2) for k, v in plan.peaks.items()})}; held "
              f"before the step {(held - baseline) / 2**30:.2f} GiB, planned states {states / 2**30:.2f} GiB; "
              f"baseline {baseline / 2**20:.0f} MiB; {versions()}")
        print("per phase, measured / planned GiB: " + ", ".join(
            f"{phase} {value / 2**30:.2f} / {plan.peaks[phase] / 2**30:.2f}" for phase, value in phases.items()))
        assert abs(plan.peak - measured) <= 0.15 * measured, (plan.peaks, measured)
        assert set(phases) == {"generation", "scoring", "training"}, phases
        for phase, value in phases.items():
            assert abs(plan.peaks[phase] - value) <= 0.15 * value, (phase, plan.peaks, phases)
    finally:
        distributed.teardown()
