"""One training step of a composed config, run on fake tensors (or real ones), phase by phase.

The models come from :mod:`.models` (a config alone, the meta device, then fake storage).

The parts are the run's own, built as :class:`rlhf_lab.training.loop.Trainer` builds them: the policy and its
reference (LoRA: the adapter-disabled policy), the precision's frozen weights, the algorithm, the KL penalty, the
:class:`~rlhf_lab.step.update.Updater` and the :class:`~rlhf_lab.step.experience.ExperienceMaker`'s engine
and scoring pass. The step is theirs too: the engine's ``generate``, the scoring pass, the algorithm's ``prepare``
and the updater's ``update``. So the plan follows the step wherever its code goes (chunked log-probs, token
budgets, packing), with no formula of its own to keep in line.

The batch: ``trainer.prompts_per_step`` prompts of ``prompt_tokens`` tokens (default ``data.max_prompt_tokens``,
the longest a run admits), each sampled ``algorithm.group_size`` times to ``trainer.max_new_tokens`` (no response
ends early): the step at its largest. The optimizer holds its state from an earlier step (a step after the first).
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import rlhf_lab.components  # noqa: F401  (registers the built-in parts)
from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.models.loading import DTYPES, PolicyAndReference
from rlhf_lab.planner import fake as fake_tensors
from rlhf_lab.planner.decode import planned_decode
from rlhf_lab.planner.fake import RealIndices
from rlhf_lab.planner.models import build_on_meta, initialise, kv_cache_bytes, materialize, storage_bytes
from rlhf_lab.registry import get
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.step.experience import ExperienceMaker, Scored
from rlhf_lab.step.update import Updater

GIB = 1 << 30
KL_COEF = 0.1  # any coefficient: memory and FLOPs do not depend on it


@dataclass
class StepPlan:
    """What one step holds (bytes) and computes (FLOPs), by phase."""

    weights: int  # the policy's parameters and buffers (and the algorithm's own networks)
    reference: int  # the frozen reference's (none under LoRA)
    optimizer: int  # AdamW's state
    kv_cache: int  # generation's key/value cache at its longest
    peaks: dict[str, int]  # phase -> bytes live at its peak: generation, scoring, training
    flops: dict[str, int]  # phase -> FLOPs
    tokens: dict[str, int]  # sampled (generated) and trained (through the training pass) tokens
    rows: int
    sequence_tokens: int  # prompt + response of one row
    engine_reservation: int = 0  # an engine's own memory beside the trainer's (vLLM's share of the GPU)
    sharded_over: int = 1  # the ranks FSDP sharded the states over in this plan (the numbers are one rank's)
    attention: str | None = None  # the attention code the plan ran (``config._attn_implementation``)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.peaks.values()) + self.engine_reservation

    @property
    def peak_phase(self) -> str:
        return max(self.peaks, key=self.peaks.__getitem__)

    @property
    def flops_per_step(self) -> int:
        return sum(self.flops.values())


def synthetic_prompts(prompts: int, tokens: int, vocab: int) -> list[list[int]]:
    """``prompts`` distinct prompts (ids as the engines take them), the first ``tokens`` long and the others
    shorter, down to half of it: a real batch's prompts differ in length, so it runs left-padded with an attention
    mask (the mask-free path some attention code takes for equal rows would plan an easier step)."""
    lengths = [tokens - (tokens // 2) * index // max(prompts - 1, 1) for index in range(prompts)]
    return [[(11 + index + position) % vocab for position in range(length)] for index, length in enumerate(lengths)]


def ordinary_token(tokenizer: Any, vocab: int) -> int:
    """A token id that is no special token (the synthetic responses never end)."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    return next(token for token in range(min(vocab, len(special) + 100)) if token not in special)


def _eos_id(tokenizer: Any) -> int | None:
    eos = tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


class _GlobalOnly:
    """In place of ``FlopCounterMode``'s module tracker: every count is the global one."""

    parents = ("Global",)

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


class StepFlops(FlopCounterMode):
    """torch's FLOP counter (its formulas, its dispatch mode) counting the global total only. Its own module tracker
    hooks the gradient of every module's inputs and outputs; under activation checkpointing the recomputed layers'
    hooks never fire, and what they hold stayed alive for the rest of the step (the memory counted beside it grew by
    each micro-batch's recomputed activations)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()


class _Phases:
    """The tracker's peak and the FLOP counter's count, per phase of the step."""

    def __init__(self, memory: Any, flops: FlopCounterMode | None) -> None:  # memory: fake.StepMemory
        self.memory, self.flop_counter = memory, flops
        self.peaks: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.indices: RealIndices | None = None  # fake tensors: the decode may stop early (:mod:`.decode`)
        self.extra_generation_flops = 0  # the FLOPs of decode steps not run (:mod:`.decode`)

    def total_flops(self) -> int:
        return self.flop_counter.get_total_flops() if self.flop_counter is not None else 0

    def run(self, name: str, work: Any) -> Any:
        gc.collect()  # garbage in reference cycles from before the phase: gone, whenever the collector would run
        if self.memory is not None:
            self.memory.start_phase()
        before = self.flop_counter.get_total_flops() if self.flop_counter is not None else 0
        result = work()
        if self.memory is not None:
            self.peaks[name] = self.memory.phase_peak
        if self.flop_counter is not None:
            self.flops[name] = self.flop_counter.get_total_flops() - before + self.extra_generation_flops
            self.extra_generation_flops = 0
        return result


def per_rank(cfg: Any, world_size: int, group_of_ranks: bool) -> Any:
    """``cfg`` as one of ``world_size`` ranks sees its batch: its share of the prompts (whole groups) and, where no
    process group tells the updater the ranks (``group_of_ranks``), of the mini-batch."""
    if world_size <= 1:
        return cfg
    from omegaconf import OmegaConf, open_dict

    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.trainer.prompts_per_step = max(1, -(-cfg.trainer.prompts_per_step // world_size))
        if cfg.algorithm.get("mini_batch_size") and not group_of_ranks:
            cfg.algorithm.mini_batch_size = max(1, cfg.algorithm.mini_batch_size // world_size)
    OmegaConf.set_readonly(cfg, False)
    return cfg


def on_device(cfg: Any, device: torch.device, longest_row: int) -> Any:
    """``cfg`` with the compute options a run on ``device`` leaves null (gradient checkpointing, the chunked
    log-probs, the token budget: :mod:`rlhf_lab.step.compute`) set as that run takes them: the planned step runs on
    CPU tensors, where the nulls would take the CPU's defaults. A null budget stretches to the longest row, as the
    run's does."""
    from omegaconf import OmegaConf, open_dict

    from rlhf_lab.step.compute import gradient_checkpointing, head_chunk, token_budget

    trainer = cfg.trainer
    resolved = {"gradient_checkpointing": gradient_checkpointing(trainer, device),
                "chunked_logprobs": bool(head_chunk(trainer, device))}
    if trainer.get("max_tokens_per_micro_batch") is None:
        budget = token_budget(trainer, device)
        resolved["max_tokens_per_micro_batch"] = max(budget, longest_row) if budget else 0
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        for key, value in resolved.items():
            cfg.trainer[key] = value
    OmegaConf.set_readonly(cfg, False)
    return cfg


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks whose collectives do nothing (torch's fake backend), for the block;
    this process is rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_step(cfg: Any, tokenizer: Any, precision: Precision, prompt_tokens: int | None = None,
              fake: bool = True, count_flops: bool = True, world_size: int = 1, fsdp: bool = False) -> StepPlan:
    """Run one step of ``cfg`` (see the module's docstring) on one of ``world_size`` ranks and return what it held
    and computed.

    ``fake=False`` runs the same step on real tensors (the calibration of the fake run); ``precision`` is the
    run's (its autocast runs on the CPU here: the byte counts are the same on a GPU). ``fsdp``: the policy and the
    reference sharded as the trainer shards them (FSDP2), over a fake process group of ``world_size`` ranks (this
    process must have no process group of its own)."""
    if fsdp:
        with fake_process_group(world_size):
            return _plan_step(cfg, tokenizer, precision, prompt_tokens, fake, count_flops, world_size, fsdp)
    return _plan_step(cfg, tokenizer, precision, prompt_tokens, fake, count_flops, world_size, fsdp)


def _plan_step(cfg: Any, tokenizer: Any, precision: Precision, prompt_tokens: int | None, fake: bool,
               count_flops: bool, world_size: int, fsdp: bool) -> StepPlan:
    cfg = per_rank(cfg, world_size, group_of_ranks=fsdp)
    prompt_tokens = int(prompt_tokens or cfg.data.max_prompt_tokens)
    cfg = on_device(cfg, torch.device(precision.device_type), prompt_tokens + cfg.trainer.max_new_tokens)
    # The step runs on CPU tensors here: a CUDA run's autocast would not touch them (every pass then in float32,
    # no half-precision copies), so the same precision's CPU autocast stands in for it.
    precision = Precision(precision.name, "cpu")
    group, prompts = cfg.algorithm.get("group_size", 1), cfg.trainer.prompts_per_step
    rows, response = prompts * group, cfg.trainer.max_new_tokens
    device = torch.device("cpu")
    models = build_on_meta(cfg, tokenizer, precision, fsdp)
    if fsdp:  # as Trainer.place_reference and distributed.wrap shard them (on the meta device: no memory yet)
        from rlhf_lab.runtime import distributed

        for module in (models.policy, models.reference):
            if module is not None:
                distributed.shard(module, precision.compute_dtype)
    config = models.policy.config
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    with ExitStack() as stack:
        stack.enter_context(fake_mode)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        for module in (models.policy, models.reference):
            if module is not None:
                materialize(module, device)
        if not fake:
            initialise(models)
        parts = _build_parts(cfg, tokenizer, models, precision, device, "fsdp" if fsdp else "single")
        updater, algorithm = parts["updater"], parts["algorithm"]
        _optimizer_state(updater)
        # The states held through the step, counted before it (FSDP's root module stays gathered after a forward).
        weights = storage_bytes(models.policy, *algorithm.modules().values())
        reference = storage_bytes(models.policy, models.reference) - storage_bytes(models.policy)
        optimizer = sum(getattr(t, "_local_tensor", t).untyped_storage().nbytes()
                        for state in updater.optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor))
        # Under FSDP torch's FSDPMemTracker counts the gathered layers and reduced gradients once (fake.py).
        memory = stack.enter_context(fake_tensors.FSDPStepMemory(models.policy, updater.optimizer) if fsdp
                                     else fake_tensors.StepMemory())
        memory.track_external(models.policy, models.reference, updater.optimizer,
                              *algorithm.modules().values())
        counter = stack.enter_context(StepFlops()) if count_flops else None
        phases = _Phases(memory, counter)
        if fake:
            phases.indices = stack.enter_context(RealIndices(ordinary_token(tokenizer, config.vocab_size),
                                                             _eos_id(tokenizer)))
        rollout = _run_step(cfg, parts, phases, synthetic_prompts(prompts, prompt_tokens, config.vocab_size), group)
        trained = int(rollout.attention_mask.sum()) * cfg.algorithm.get("epochs", 1)
        del rollout
    engine = cfg.generation.get("name", "hf")
    return StepPlan(
        weights=weights,
        reference=reference,
        optimizer=optimizer,
        kv_cache=kv_cache_bytes(config, rows, prompt_tokens + response, _cache_dtype(precision))
        if engine == "hf" else 0,
        peaks=phases.peaks, flops=phases.flops,
        tokens={"sampled": rows * response, "trained": trained},
        rows=rows, sequence_tokens=prompt_tokens + response, sharded_over=world_size if fsdp else 1,
        attention=getattr(config, "_attn_implementation", None))


def _cache_dtype(precision: Precision) -> torch.dtype:
    return precision.compute_dtype or DTYPES[precision.weights_dtype]


def _build_parts(cfg: Any, tokenizer: Any, models: PolicyAndReference, precision: Precision,
                 device: torch.device, strategy: str) -> dict[str, Any]:
    """The algorithm, KL penalty, updater and experience maker, as the trainer builds them."""
    algorithm = get("algorithm", cfg.algorithm.name)(cfg.algorithm)
    algorithm.scales_kl = cfg.kl.get("loss_scale", "none") == "advantage"
    algorithm.setup(models.policy)
    kl = KLPenalty(cfg.kl)
    hardware = HardwareProfile()
    updater = Updater(cfg, models.policy, algorithm, kl, device, precision, strategy, None, hardware)
    worker = None
    if cfg.generation.get("name", "hf") != "hf":  # another engine's memory is its reservation: sample with hf's
        from rlhf_lab.generation.backend import SamplingSettings
        from rlhf_lab.generation.hf import HFGeneration
        from rlhf_lab.generation.worker import RolloutWorker

        engine = HFGeneration(models.policy, tokenizer, SamplingSettings.from_config(cfg), precision, hardware,
                              options=cfg.generation, keep_logits=False)
        worker = RolloutWorker(engine, models.policy)
    maker = ExperienceMaker(cfg, tokenizer, models, models.policy, None, kl, device, precision,
                            keep_hidden=algorithm.reads_sampling_hidden, hardware=hardware, worker=worker)
    return {"algorithm": algorithm, "kl": kl, "updater": updater, "maker": maker}


def _optimizer_state(updater: Updater) -> None:
    """AdamW's state as after an earlier step (zero gradients, one optimizer step; then no gradients)."""
    for parameter in updater.parameters:
        parameter.grad = torch.zeros_like(parameter)
    updater.optimizer.step()
    updater.optimizer.zero_grad(set_to_none=True)


def _run_step(cfg: Any, parts: dict[str, Any], phases: _Phases, prompts: list[list[int]], group: int) -> Any:
    """Generation, the scoring pass, then the algorithm's advantages and the update: the trainer's step
    (:meth:`rlhf_lab.step.experience.ExperienceMaker.make` and :meth:`rlhf_lab.training.loop.Trainer.train_step`)
    without the reward and the records."""
    maker, updater, algorithm = parts["maker"], parts["updater"], parts["algorithm"]
    timer = StepTimer()
    exact = maker.exact_kl == "step"
    sources = maker.plan.for_batch(exact, train=True)
    maker.keep_sampler_logits(exact, sources)  # as the trainer's step does
    # The batch of each stage replaces the last one's in ``held`` (as the trainer's step drops it): no phase keeps
    # an earlier stage's tensors (the engine's kept logits) alive.
    held: list[Any] = [phases.run("generation", lambda: planned_decode(maker.engine, prompts, group, phases,
                                                                   cfg.trainer.max_new_tokens))]
    held[0] = Scored.from_samples(held[0], scores=torch.zeros(held[0].batch_size, device=held[0].logprobs.device))

    def score() -> None:
        held[0] = maker.score(held[0], timer, exact, sources, KL_COEF)

    phases.run("scoring", score)

    def train() -> None:
        held[0], _ = algorithm.training_batch(held[0].for_training(), updater.forward,
                                              keep_ref_logits=maker.update_needs_ref_logits)
        updater.update(held[0], KL_COEF, 0, timer)

    phases.run("training", train)
    return held[0]
