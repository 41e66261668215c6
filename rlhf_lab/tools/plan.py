"""``rlhf-lab plan [overrides] [--device cpu|cuda] [--world-size N] [--device-memory GIB] [--peak-tflops T]
[--versions FILE]``.

The memory and FLOPs of one training step of the composed config, predicted without a GPU: the step's own code
run on fake tensors (:mod:`rlhf_lab.planner`), phase by phase. A model may be given by its ``config.json`` alone
(``model=path model.name_or_path=DIR``, a folder with ``config.json``, no weights; without a tokenizer its shapes
stand in for one: :class:`~rlhf_lab.planner.models.ShapesTokenizer`). Prints a table,
then one line of JSON: ``{"peak_gib": ..., "fits": ..., "phases": {...}, "flops_per_step": ..., "versions": {...}}``
(``versions``: torch, transformers, peft, the attention code and the device the plan was made with).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlhf_lab.errors import ToolError, UserError

GIB = 1 << 30
# What a folder holds where it has a tokenizer (transformers builds an empty one from a folder with none of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt")
DEFAULT_GPU_GIB = 80.0  # an 80 GB GPU where none is visible to ask


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf-lab plan", description=__doc__.split("\n\n")[1])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for a run (model=..., trainer.*=...)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="the device planned for (default: the run's)")
    p.add_argument("--world-size", type=int, default=1, help="processes (ranks) of the run (default 1)")
    p.add_argument("--device-memory", type=float, default=None,
                   help="GiB per device (default: this machine's available memory for cpu, the GPU's or 80 for cuda)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device, for MFU (default: trainer.peak_tflops, or the GPU's by name)")
    p.add_argument("--step-seconds", type=float, default=None, help="a step's measured time: the MFU it implies")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt tokens per row (default: the data's longest prompt where it can be read here, else "
                        "data.max_prompt_tokens, the longest a run admits)")
    p.add_argument("--no-advice", dest="advice", action="store_false",
                   help="where the run does not fit, skip planning the changes that would make it fit")
    p.add_argument("--versions", default=None, metavar="FILE",
                   help="the versions.json of the run the plan stands for (benchmarks/gpu_check.sh writes one): "
                        "refused in one line where this environment's torch, transformers or attention code differ")
    return p


def check_flags(args: argparse.Namespace) -> None:
    """A size, a time or a throughput that is not a positive number is one line (0 would plan nothing, or silently
    fall back to the default)."""
    import math

    for flag in ("world_size", "device_memory", "peak_tflops", "step_seconds", "prompt_tokens"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ToolError(f"--{flag.replace('_', '-')} {value}: must be a positive number")


def planned_device(cfg: Any, flag: str | None) -> str:
    """``--device``, else the run's ``trainer.device`` (auto: cuda where one is visible)."""
    if flag:
        return flag
    import torch

    wanted = str(cfg.trainer.device)
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if wanted.startswith("cuda") else "cpu"


def device_memory(device: str, flag: float | None) -> int | None:
    """Bytes per device: ``--device-memory``, else what this machine has (available host memory; the GPU's total),
    else 80 GiB for a GPU not visible here."""
    if flag is not None:
        return int(flag * GIB)
    import torch

    if device == "cuda":
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
        return int(DEFAULT_GPU_GIB * GIB)
    from rlhf_lab.training.memory_check import available_memory

    return available_memory(torch.device("cpu"))


def peak_tflops(cfg: Any, device: str, flag: float | None) -> float | None:
    if flag is not None:
        return flag
    configured = cfg.trainer.get("peak_tflops")
    if configured:
        return float(configured)
    import torch

    if device == "cuda" and torch.cuda.is_available():
        from rlhf_lab.planner.report import peak_tflops_of

        return peak_tflops_of(torch.cuda.get_device_name(0))
    return None


def run_precision(cfg: Any, device: str) -> Any:
    """The run's precision on ``device`` (``auto`` on a GPU: bf16-mixed); the plan runs its autocast on this CPU and
    the compute options ``device``'s run leaves null as that run takes them."""
    import torch

    from rlhf_lab.runtime.precision import Precision, resolve_precision

    if device == "cuda" and cfg.trainer.precision == "auto" and cfg.trainer.dtype is None:
        name = "bf16-mixed"
    else:
        name = resolve_precision(cfg.trainer.precision, cfg.trainer.dtype, warn=False, device=torch.device(device)
                                 if device == "cpu" else None)
    return Precision(name, device)


def data_prompt_tokens(cfg: Any, tokenizer: Any) -> tuple[int, int] | None:
    """(the longest of the run's prompts in tokens, formatted as the run formats them and within
    ``data.max_prompt_tokens``; how many prompts), or None where the data cannot be read here (a hub set offline, a
    missing file) or there is no tokenizer to count with."""
    from rlhf_lab.data.prompts import format_prompts, load_prompts
    from rlhf_lab.generation.backend import encode_prompts
    from rlhf_lab.planner.models import ShapesTokenizer

    if isinstance(tokenizer, ShapesTokenizer):
        return None
    try:
        splits = load_prompts(cfg.data, seed=cfg.seed)
    except (UserError, OSError, ValueError):
        return None
    prompts = [*splits.train, *splits.eval]
    if not prompts:
        return None
    formatted = format_prompts(prompts, tokenizer, cfg.model.chat_template, cfg.model.system_prompt)
    longest = max(len(ids) for ids in encode_prompts(tokenizer, formatted))
    return min(longest, int(cfg.data.max_prompt_tokens)), len(prompts)


def make_plan(overrides: list[str], device: str | None = None, world_size: int = 1,
              memory_gib: float | None = None, prompt_tokens: int | None = None,
              notes: list[str] | None = None) -> Any:
    """The :class:`~rlhf_lab.planner.report.DevicePlan` of the config ``overrides`` compose to; ``notes`` gets a line
    for each assumption the plan made that the config did not state (said once the plan is made)."""
    notes = [] if notes is None else notes
    from rlhf_lab.config.compose import compose
    from rlhf_lab.models.loading import load_tokenizer
    from rlhf_lab.planner.models import ShapesTokenizer, check_config_file
    from rlhf_lab.planner.report import DevicePlan, engine_reservation
    from rlhf_lab.planner.step import plan_step
    from rlhf_lab.runtime import distributed
    from rlhf_lab.runtime.distributed import resolve_strategy

    if world_size < 1:
        raise ToolError(f"--world-size must be 1 or more; got {world_size}")
    # A model given by its config.json alone: planned without weights (the trainer would refuse the folder).
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("model.name_or_path=")]
    cfg = compose(list(overrides), pending_paths=given)
    device = planned_device(cfg, device)
    memory = device_memory(device, memory_gib)
    if cfg.model.get("name_or_path"):
        check_config_file(cfg.model.name_or_path)  # impossible shapes: one line before transformers divides by them
    folder = Path(str(cfg.model.name_or_path)) if cfg.model.get("name_or_path") else None
    missing = "it holds no tokenizer file" if folder is not None and folder.is_dir() and not any(
        (folder / name).is_file() for name in TOKENIZER_FILES) else None
    try:
        tokenizer = None if missing else load_tokenizer(cfg.model)
    except (OSError, ValueError) as error:
        if not cfg.model.get("name_or_path"):
            raise
        missing = str(error).splitlines()[0][:80]
    if tokenizer is None:  # a plan needs shapes, not text: the config's vocabulary and special ids stand in
        from transformers import AutoConfig

        tokenizer = ShapesTokenizer(AutoConfig.from_pretrained(cfg.model.name_or_path))
        notes.append(f"plan: no tokenizer in {cfg.model.name_or_path} ({missing}); planned from config.json's "
                     f"shapes: a vocabulary of {len(tokenizer)}, pad id {tokenizer.pad_token_id}")
    strategy = cfg.trainer.strategy if world_size == 1 else resolve_strategy(cfg.trainer.strategy, world_size)
    if strategy == "fsdp" and distributed.is_distributed():  # the plan runs over a fake process group of its own
        raise ToolError(f"an FSDP plan (--world-size {world_size}) needs a process without a process group; this one "
                        f"has one ({distributed.world_size()} ranks): run `rlhf-lab plan` in a process of its own")
    if prompt_tokens is None:  # the data's own longest prompt where it can be read, else the longest admitted
        measured = data_prompt_tokens(cfg, tokenizer)
        if measured is not None:
            prompt_tokens = measured[0]
            notes.append(f"plan: prompts of {prompt_tokens} tokens, the longest of the data's {measured[1]} (data."
                         f"max_prompt_tokens={cfg.data.max_prompt_tokens} admits up to it; --prompt-tokens plans "
                         "another)")
    step = plan_step(cfg, tokenizer, run_precision(cfg, device), prompt_tokens=prompt_tokens, world_size=world_size,
                     fsdp=strategy == "fsdp")
    reservation, sleeps = engine_reservation(cfg, device, memory)
    return DevicePlan(step, device, world_size, memory, strategy == "fsdp", reservation, sleeps), cfg


def candidates(cfg: Any, world_size: int) -> list[list[str]]:
    """What docs/guides/plan.md lists to make a run fit, as overrides this config does not already have: LoRA, the
    reference offloaded, activation checkpointing, one row per micro-batch, half the response length, FSDP over 8."""
    trainer, lora = cfg.trainer, cfg.model.get("lora") or {}
    found: list[list[str]] = []
    if not lora.get("enabled", False):
        found.append(["model.lora.enabled=true"])
        if not trainer.offload_reference:
            found.append(["trainer.offload_reference=true"])
    if trainer.gradient_checkpointing is not True:
        found.append(["trainer.gradient_checkpointing=true"])
    if trainer.micro_batch_size != 1 and trainer.get("max_tokens_per_micro_batch") is None:
        found.append(["trainer.micro_batch_size=1"])
    if trainer.max_new_tokens > 1:
        found.append([f"trainer.max_new_tokens={trainer.max_new_tokens // 2}"])
    if world_size == 1:
        found.append(["trainer.strategy=fsdp", "--world-size", "8"])
    return found


def advice(args: argparse.Namespace, cfg: Any, prompt_tokens: int) -> list[tuple[list[str], Any]]:
    """Each candidate change (:func:`candidates`) to the run ``args`` plan, planned on its own with the prompt length
    the run's plan took (the data read once): (its overrides and flags, its plan)."""
    planned = []
    for change in candidates(cfg, args.world_size):
        world = int(change[-1]) if "--world-size" in change else args.world_size
        overrides = [item for item in change if not item.startswith("--") and not item.isdigit()]
        plan, _ = make_plan([*args.overrides, *overrides], args.device, world, args.device_memory, prompt_tokens)
        planned.append((change, plan))
    return planned


def advice_lines(planned: list[tuple[list[str], Any]]) -> list[str]:
    lines = ["what would make it fit, each change planned on its own:"]
    for change, plan in planned:
        phase = max(("generation", "scoring", "training"), key=plan.phases().__getitem__)
        lines.append(f"  {' '.join(change):<44}{plan.peak / GIB:>10.3f} GiB ({phase}): "
                     f"{'fits' if plan.fits else 'does NOT fit'}")
    return lines


def main(argv: list[str]) -> None:
    from rlhf_lab.planner.report import table
    from rlhf_lab.runtime.versions import check_reproducible, environment, read_versions

    args = parser().parse_intermixed_args(argv)
    try:
        check_flags(args)
        wanted = None if args.versions is None else read_versions(args.versions)
        if wanted is not None:  # torch and transformers before the plan's seconds, its attention code after
            check_reproducible(environment("cpu", None), wanted, args.versions)
        notes: list[str] = []
        plan, cfg = make_plan(args.overrides, args.device, args.world_size, args.device_memory, args.prompt_tokens,
                              notes)
        if wanted is not None:
            check_reproducible(environment(plan.device, plan.step.attention), wanted, args.versions)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    tflops = peak_tflops(cfg, plan.device, args.peak_tflops)
    for note in notes:
        print(note, file=sys.stderr)
    print(table(plan, tflops, args.step_seconds))
    try:
        prompt_tokens = plan.step.sequence_tokens - cfg.trainer.max_new_tokens
        planned = advice(args, cfg, prompt_tokens) if plan.fits is False and args.advice else []
    except UserError as error:  # a change this config cannot take (an option it refuses): no advice, one line
        print(f"plan: no advice ({error})", file=sys.stderr)
        planned = []
    summary = plan.summary(tflops, args.step_seconds)
    if planned:
        print("\n".join(advice_lines(planned)))
        summary["advice"] = [{"change": " ".join(change), "peak_gib": round(p.peak / GIB, 3), "fits": bool(p.fits)}
                             for change, p in planned]
    print(json.dumps(summary))
