"""Will the run fit? An estimate of its memory from the config, checked before the model is built.

The parameters are counted on the meta device (the model's config read, no weights allocated); with LoRA the
adapter is counted the same way. Bytes, per process:

- weights: (parameters + adapter) x bytes of the weight dtype;
- gradients: trainable x the same bytes (trainable: the adapter under LoRA, else every parameter);
- AdamW: 2 x trainable x the same bytes (its two moments);
- reference: parameters x the same bytes for the frozen copy of full fine-tuning (none under LoRA, where the
  reference is the adapter-disabled policy; on the host, not the GPU, with ``trainer.offload_reference``);
- activations of one micro-batch: rows x tokens x (logits width + layers x hidden size) x bytes of the compute
  dtype: its logits ([rows, tokens, vocab]; one [chunk, vocab] chunk where the on-policy passes take the LM head
  in chunks) and each layer's hidden states. A micro-batch is one rank's (``trainer.micro_batch_size`` rows, else
  its share of the mini-batch or of the step's samples), and no more rows than the token budget holds.

Under FSDP the first four are split over the processes. It leaves out what is small or varies (the KV cache of
generation, the allocator's slack): it is a floor, not a promise. The estimate is compared with the memory
available (free CUDA memory on a GPU; the host's available memory otherwise); a run over it stops in one line,
and ``trainer.skip_memory_check=true`` starts it anyway.

An on-policy training run in one process (the trainer passes its ``precision``) whose estimate comes within a factor
``PLAN_WITHIN`` of the memory available is planned instead (:mod:`rlhf_lab.planner`: the step's own code on fake
tensors, every phase's peak, the engine's reservation included; the estimate above counts logits at every token and
no generation), and stops in one line where the planned peak does not fit. Runs far below the memory available
start without the plan's few seconds; runs whose weights, gradients, optimizer state and reference alone are over it
stop at once, without the plan's seconds to minutes (a large model's plan is slow, and no batch makes those fit).
A sweep whose jobs run in the ``rlhf-lab`` process stops so, naming the job, before its first job starts
(:mod:`rlhf_lab.training.sweep_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from rlhf_lab.errors import ConfigError
from rlhf_lab.models.loading import model_config

GIB = 1 << 30
ADAM_MOMENTS = 2  # AdamW keeps exp_avg and exp_avg_sq per trainable parameter
PLAN_WITHIN = 4  # a run whose floor is above 1/PLAN_WITHIN of the memory available is planned
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class ModelSize:
    """The shapes the estimate needs, read from a model's config."""

    parameters: int  # the network's own (no adapter)
    adapter: int  # LoRA's trainable parameters; 0 for full fine-tuning
    vocab: int
    hidden_size: int
    layers: int
    context: int | None = None  # the model's context (max_position_embeddings): no row is longer


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run holds at its peak, by what holds them."""

    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int

    @property
    def total(self) -> int:
        return sum(getattr(self, field.name) for field in fields(self))

    @property
    def held(self) -> int:
        """Weights, gradients, optimizer state and reference: held at the training peak whatever the batch."""
        return self.total - self.activations


def estimate_memory(size: ModelSize, weight_bytes: int, compute_bytes: int, rows: int, tokens: int,
                    reference: bool, logits_width: int | None = None, shards: int = 1,
                    reference_bytes: int | None = None) -> MemoryEstimate:
    """The bytes of weights, gradients, AdamW moments, the reference copy and one micro-batch's activations
    (formulas in the module's docstring). ``logits_width``: the head's outputs per token (default: the
    vocabulary); ``shards``: the processes FSDP splits the model's states over; ``reference_bytes``: per weight
    of the reference (default: the weights')."""
    trainable = size.adapter or size.parameters
    width = size.vocab if logits_width is None else logits_width
    return MemoryEstimate(
        weights=(size.parameters + size.adapter) * weight_bytes // shards,
        gradients=trainable * weight_bytes // shards,
        optimizer=ADAM_MOMENTS * trainable * weight_bytes // shards,
        reference=(size.parameters * (reference_bytes or weight_bytes) // shards
                   if reference and not size.adapter else 0),
        activations=rows * tokens * (width + size.layers * size.hidden_size) * compute_bytes,
    )


def model_size(model_cfg: Any, tokenizer: Any) -> ModelSize | None:
    """Parameter counts of ``model=`` (and its LoRA adapter), built on the meta device: nothing is allocated."""
    from transformers import AutoModelForCausalLM

    from rlhf_lab.models.loading import apply_lora

    try:
        config = model_config(model_cfg, tokenizer)
    except (OSError, ValueError):  # no readable config: loading the model says why, in its own words
        return None
    if config is None:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        parameters = sum(p.numel() for p in model.parameters())
        adapter = 0
        if model_cfg.lora.enabled:
            adapter = sum(p.numel() for p in apply_lora(model, model_cfg.lora).parameters() if p.requires_grad)
    return ModelSize(parameters, adapter, config.vocab_size, config.hidden_size, config.num_hidden_layers,
                     getattr(config, "max_position_embeddings", None))


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still allocate: free CUDA memory on a GPU, the host's available memory
    (psutil, else ``/proc/meminfo``) otherwise; None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in MEMINFO.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def micro_batch_rows(cfg: Any, processes: int = 1) -> int:
    """Rows of one forward/backward pass of one of ``processes`` ranks: ``trainer.micro_batch_size`` (a rank's),
    else the rank's share of ``algorithm.mini_batch_size``, else of the step's samples (whole prompt groups)."""
    group = cfg.algorithm.get("group_size", 1)
    samples = -(-cfg.trainer.prompts_per_step // processes) * group
    mini_batch = cfg.algorithm.get("mini_batch_size")
    return cfg.trainer.micro_batch_size or (mini_batch and max(1, mini_batch // processes)) or samples


def tokens_per_row(cfg: Any) -> int:
    """The longest row: ``algorithm.max_length`` where the stage cuts its texts there, else the prompt's tokens
    plus the response's (``data.max_response_tokens`` of demonstrations and pairs, else
    ``trainer.max_new_tokens``)."""
    if cfg.algorithm.get("max_length"):
        return int(cfg.algorithm.max_length)
    response = cfg.data.get("max_response_tokens") or cfg.trainer.max_new_tokens
    return int(cfg.data.get("max_prompt_tokens", 0)) + int(response)


def local_model_size(model_cfg: Any) -> ModelSize | None:
    """:func:`model_size` from this machine's files alone, no weights read and nothing downloaded: ``model=tiny`` over
    its tokenizer's vocabulary, a folder's ``config.json`` (a hub id's in the local cache), the embedded model once
    unpacked; None where only a download or reading weights (the embedded model's first unpacking) would tell."""
    from huggingface_hub import try_to_load_from_cache

    from rlhf_lab.models.loading import load_tokenizer, smollm2_model_folder

    if model_cfg.name == "exact":
        return None
    if model_cfg.name == "tiny" and not model_cfg.name_or_path:
        try:
            return model_size(model_cfg, load_tokenizer(model_cfg))
        except OSError:  # the embedded tokenizer's package is missing: the run says so
            return None
    folder = Path(model_cfg.name_or_path).expanduser() if model_cfg.name_or_path else smollm2_model_folder()
    if not folder.is_dir() and model_cfg.name_or_path:  # a hub id: its config.json where the cache holds it
        try:
            cached = try_to_load_from_cache(model_cfg.name_or_path, "config.json")
        except ValueError:  # not a hub id either: validation names it
            cached = None
        folder = Path(cached).parent if isinstance(cached, str) else folder
    if not (folder / "config.json").is_file():
        return None
    local = model_cfg.copy()
    local.name_or_path = str(folder)
    return model_size(local, None)


def run_estimate(cfg: Any, size: ModelSize, weight_dtype: torch.dtype, compute_dtype: torch.dtype | None,
                 device: torch.device, rows: int | None = None, logits_width: int | None = None, shards: int = 1,
                 reference: bool = True, precision: Any = None, processes: int = 1) -> tuple[MemoryEstimate, int]:
    """The estimate :func:`check_memory` compares with the memory available (its arguments), and the rows of its
    micro-batch."""
    offloaded = cfg.trainer.offload_reference and device.type == "cuda"  # the copy lives in host memory
    tokens = min(tokens_per_row(cfg), size.context or tokens_per_row(cfg))  # a longer prompt is refused later
    if rows is None:
        rows = micro_batch_rows(cfg, processes)
        if precision is not None:  # the on-policy passes: micro-batches by the token budget, the head in chunks
            from rlhf_lab.step.compute import head_chunk, token_budget

            budget = token_budget(cfg.trainer, device)
            rows = min(rows, max(1, budget // tokens)) if budget else rows
            chunk = head_chunk(cfg.trainer, device)
            if chunk and logits_width is None:  # one chunk's [chunk, vocab] logits, spread over the tokens
                logits_width = min(size.vocab, -(-chunk * size.vocab // (rows * tokens)))
    # The frozen reference is made in the compute dtype (trainer: models.loading.build_policy's reference_dtype).
    reference_bytes = (compute_dtype or weight_dtype).itemsize if precision is not None else None
    estimate = estimate_memory(size, weight_dtype.itemsize, (compute_dtype or weight_dtype).itemsize, rows,
                               tokens, reference=reference and not offloaded, logits_width=logits_width,
                               shards=shards, reference_bytes=reference_bytes)
    return estimate, rows


def check_memory(cfg: Any, tokenizer: Any, weight_dtype: torch.dtype, compute_dtype: torch.dtype | None,
                 device: torch.device, rows: int | None = None, logits_width: int | None = None,
                 shards: int = 1, reference: bool = True, precision: Any = None,
                 processes: int = 1) -> MemoryEstimate | None:
    """Refuse in one line a run whose estimate (:func:`estimate_memory`) exceeds the memory available, unless
    ``trainer.skip_memory_check``; returns the estimate (None when skipped or not made). ``rows``: of one
    micro-batch (default :func:`micro_batch_rows` of one of ``processes`` ranks, within the token budget);
    ``reference``: whether full fine-tuning keeps a frozen copy; ``precision``: the on-policy run's, whose planned
    step decides where the estimate comes close (:func:`check_plan`), and whose passes take the LM head in chunks
    where ``trainer.chunked_logprobs`` says (no [rows, tokens, vocab] logits)."""
    if cfg.trainer.get("skip_memory_check"):
        return None
    size = model_size(cfg.model, tokenizer)
    available = available_memory(device)
    if size is None or available is None:
        return None
    estimate, rows = run_estimate(cfg, size, weight_dtype, compute_dtype, device, rows, logits_width, shards,
                                  reference, precision, processes)
    if device.type == "cuda" and (cfg.get("generation") or {}).get("name") == "vllm":
        check_engine_share(cfg, estimate.weights + estimate.reference, available,
                           torch.cuda.get_device_properties(device).total_memory)
    refuse_held(cfg, estimate, rows, available, device)
    if precision is not None and not multi_process() and estimate.total * PLAN_WITHIN > available:
        check_plan(cfg, tokenizer, precision, device, available)  # close: the planned step decides
        return estimate
    if estimate.total > available:
        raise over_memory(cfg, estimate, rows, available, device)
    return estimate


def refuse_held(cfg: Any, estimate: MemoryEstimate, rows: int, available: int, device: torch.device) -> None:
    """Close to the memory available the planned step decides; but where the weights, gradients, optimizer state
    and reference alone (:attr:`MemoryEstimate.held`) are over it, no batch and no plan can fit: refused at once,
    without the plan's seconds to minutes. A sweep refuses so each job before the first starts
    (:mod:`rlhf_lab.training.sweep_memory`)."""
    if estimate.held > available:
        raise over_memory(cfg, estimate, rows, available, device)


def over_memory(cfg: Any, estimate: MemoryEstimate, rows: int, available: int, device: torch.device) -> ConfigError:
    """The one-line refusal of a run whose estimate exceeds ``available`` bytes."""
    return ConfigError(f"this run needs about {estimate.total / GIB:.3g} GiB ({breakdown(estimate)}), this "
                       f"machine has {available / GIB:.3g} GiB available on {device.type}; lower "
                       f"{remedy(cfg, estimate, rows)}, or set trainer.skip_memory_check=true to start anyway")


def check_engine_share(cfg: Any, held: int, free: int, total: int) -> None:
    """Refuse in one line a colocated vLLM engine that cannot start: vLLM starts only where the GPU's free memory
    is at least ``generation.gpu_memory_utilization`` × its ``total`` when the engine is built, and by then the
    trainer's weights and reference (``held`` bytes) are on the GPU; ``free``: what is free before them."""
    from rlhf_lab.generation.vllm import GPU_MEMORY_UTILIZATION

    fraction = float(cfg.generation.get("gpu_memory_utilization") or GPU_MEMORY_UTILIZATION)
    if fraction * total <= free - held:
        return
    fits = max(0.0, (free - held) / total)
    raise ConfigError(f"generation.gpu_memory_utilization={fraction:g} asks vLLM for {fraction * total / GIB:.3g} GiB of "
                      f"the {total / GIB:.3g} GiB GPU when its engine starts, and {free / GIB:.3g} GiB are free before "
                      f"the trainer's weights and reference take {held / GIB:.3g} GiB: at most {int(fits * 100) / 100:g} "
                      "fits beside them (vLLM refuses to start otherwise); lower generation.gpu_memory_utilization, "
                      "train an adapter (model.lora.enabled=true), set trainer.offload_reference=true, or sample on "
                      "another GPU (generation=vllm_server)")


PHASE_REMEDIES = {
    "generation": "trainer.prompts_per_step or trainer.max_new_tokens (the decode's cache and kept logits)",
    "scoring": "trainer.logprob_chunk (rows per chunk of the scoring pass) or the tokens per row",
    "training": "trainer.micro_batch_size, set trainer.gradient_checkpointing=true, or lower the tokens per row",
}


def multi_process() -> bool:
    """Whether this process is one rank of several (torchrun): its step is not planned here (the planner runs the
    step alone; ``rlhf-lab plan --world-size N`` plans a rank of N)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_plan(cfg: Any, tokenizer: Any, precision: Any, device: torch.device, available: int) -> Any:
    """Plan the step of a one-process run (:func:`rlhf_lab.planner.step.plan_step`, as ``rlhf-lab plan`` does) and
    refuse it in one line where its peak exceeds ``available`` bytes; returns the plan."""
    from rlhf_lab.planner.report import DevicePlan, engine_reservation
    from rlhf_lab.planner.step import plan_step

    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else available
    reservation, sleeps = engine_reservation(cfg, device.type, total)
    step = plan_step(cfg, tokenizer, precision, count_flops=False)
    plan = DevicePlan(step, device.type, 1, available, False, reservation, sleeps)
    if plan.fits:
        return plan
    phases = plan.phases()
    peak_phase = max(("generation", "scoring", "training"), key=phases.__getitem__)
    parts = ", ".join(f"{name} {phases[name] / GIB:.3g}" for name in ("weights", "reference", "optimizer")
                      if phases[name])
    raise ConfigError(f"this run needs about {plan.peak / GIB:.3g} GiB at its {peak_phase} peak (planned: {parts}, "
                      f"{peak_phase} {phases[peak_phase] / GIB:.3g}; rlhf-lab plan shows every phase and plans what "
                      f"would fit), this machine has {available / GIB:.3g} GiB available on {device.type}; lower "
                      f"{PHASE_REMEDIES[peak_phase]}, or "
                      "set trainer.skip_memory_check=true to start anyway")


def breakdown(estimate: MemoryEstimate) -> str:
    """The estimate's parts in GiB, the empty ones left out."""
    parts = {"weights": estimate.weights, "gradients": estimate.gradients, "AdamW": estimate.optimizer,
             "reference": estimate.reference, "activations": estimate.activations}
    return ", ".join(f"{name} {size / GIB:.3g}" for name, size in parts.items() if size)


def remedy(cfg: Any, estimate: MemoryEstimate, rows: int) -> str:
    """The keys that shrink the largest part of the estimate."""
    if estimate.activations >= estimate.total - estimate.activations:
        return f"trainer.micro_batch_size (now {rows} rows) or the tokens per row"
    if not cfg.model.lora.enabled:
        return "the model's size or train an adapter (model.lora.enabled=true)"
    return "the model's size or model.lora.r"
