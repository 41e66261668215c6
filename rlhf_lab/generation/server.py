"""vLLM as a separate server (``rlhf-lab serve``) and its client engine (``generation=vllm_server``).

The server holds one vLLM engine (on its own GPUs, or this CPU) and answers JSON over HTTP:

- ``POST /generate``: prompts as token ids, samples per prompt, sampling settings, per-prompt seeds, stop
  strings, greedy -> the sampled token ids and the engine's log-probs;
- ``POST /load_weights``: the safetensors shards of a folder (full weights) become the engine's;
- ``POST /load_adapter``: a LoRA adapter folder becomes the one it samples with (the base weights stay);
- ``POST /open_group``: join the trainer's rank 0 in a process group of two (:mod:`.weight_group`);
- ``POST /receive_weights``: the full weights the trainer broadcasts over that group become the engine's;
- ``GET /health``;
- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI's routes, with the sampled token ids and their
  log-probs as vLLM's OpenAI server returns them (:mod:`.openai_routes`), for agent programs and ``env=verifiers``.

Any number of trainer ranks share it: each sends its own prompts (the server answers one request at a time).
After every optimizer step the weights reach it by ``generation.weight_sync``:

- ``collective``: broadcast from the trainer's rank 0 over a process group it shares with the server (NCCL
  between GPUs, gloo otherwise), no file written;
- ``folder`` (the default, and always for a LoRA adapter): rank 0 writes them to ``generation.sync_folder``, a
  folder both sides read, and tells the server to load them.

Under FSDP every rank takes part in gathering the weights, one parameter at a time; the other ranks wait at a
barrier, so no rank samples with the old weights.
"""

from __future__ import annotations

import http.client
import json
import shutil
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.config.choices import sync_folder_needed
from rlhf_lab.errors import ConfigError, EngineError
from rlhf_lab.generation.backend import Prompt, SamplingSettings, encode_prompts
from rlhf_lab.generation.rollout import Samples
from rlhf_lab.generation.serve_engine import VLLMServerEngine
from rlhf_lab.generation.serve_token import client_token
from rlhf_lab.generation.serving import WeightServer, serve
from rlhf_lab.generation.vllm import hf_name, samples_rollout, streamed_state
from rlhf_lab.generation.weight_group import WeightGroup
from rlhf_lab.registry import register
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.precision import Precision

__all__ = ["VLLMServerEngine", "VLLMServerGeneration", "WeightServer", "serve"]  # the server: .serving


# ------------------------------------------------------------------------------------------ the client engine

def _post(url: str, body: dict[str, Any], token: str, timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{url}: {json.loads(error.read()).get('error', error)}") from None
    except urllib.error.URLError as error:
        raise ConfigError(f"generation.url: no rlhf-lab serve answers at {url} ({error.reason}); start one with "
                          "rlhf-lab serve MODEL --port N") from None
    except (http.client.HTTPException, ConnectionError) as error:  # the server's process went away mid-request
        raise EngineError(f"generation.url: rlhf-lab serve at {url} stopped answering mid-request "
                          f"({type(error).__name__}); the run stops here and what it wrote is kept: start the server "
                          "again and resume with trainer.resume=auto") from None


def token_versions(versions: list[list[int]], response_mask: Tensor) -> Tensor:
    """[B, T] long: the server's version of each sampled token (``versions``, one list per sample), 0 off the
    response."""
    rows = response_mask.shape[0]
    valid = len(versions) == rows and all(
        isinstance(row, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)
        for row in versions)
    if not valid:
        raise RuntimeError(f"the server's versions {versions!r} are not {rows} lists of versions (integers >= 0)")
    width = response_mask.shape[1]
    known = torch.tensor([row[:width] + [0] * (width - len(row[:width])) for row in versions], dtype=torch.long,
                         device=response_mask.device)
    return known * (response_mask > 0)


MISMATCH = ("do not fit the served model", "is not one of the model's", ", the model's is ")  # the server's words


def _health(url: str, token: str) -> dict[str, Any]:
    """``GET /health`` of the ``rlhf-lab serve`` at ``url``: the model it was started with, whether it takes weights
    in flight."""
    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _served_model(url: str, token: str) -> str:
    """The model ``rlhf-lab serve`` at ``url`` was started with."""
    try:
        return str(_health(url, token).get("model") or "an unnamed model")
    except (OSError, ValueError):
        return "a model it did not name"


@register("generation", "vllm_server")
class VLLMServerGeneration:
    """A :class:`~rlhf_lab.generation.backend.GenerationBackend` that samples on an ``rlhf-lab serve`` server
    (``generation.url``) and syncs weights over a process group or through ``generation.sync_folder`` (see the
    module)."""

    reports_entropy = False
    holds_weights = True  # the server's copy, which the rollout worker keeps the policy's (generation/worker.py)
    starts_current = False  # the server may hold other weights than the policy's: the worker loads them first

    def __init__(self, policy: nn.Module, tokenizer: Any, settings: SamplingSettings,
                 precision: Precision | None = None, hardware: Any = None, options: Any = None,
                 keep_logits: bool = False, keep_hidden: bool = False, logits_float32: bool = True) -> None:
        options = options or {}
        self.policy, self.tokenizer, self.settings = policy, tokenizer, settings
        self.device = next(policy.parameters()).device
        # Weights written for the server in the dtype the trainer computes in (bf16-mixed: bfloat16, half of the
        # float32 masters; what ``rlhf-lab serve --dtype auto`` runs on a GPU): None keeps them as they are.
        self.wire_dtype = (precision or Precision("fp32", self.device.type)).compute_dtype
        self.keep_logits = False
        self.url = str(options.get("url") or "http://127.0.0.1:8765").rstrip("/")
        self.lora = hasattr(policy, "peft_config")
        collective = options.get("weight_sync", "folder") == "collective" and not self.lora  # adapters: the folder
        if not collective and not options.get("sync_folder"):
            raise ConfigError(sync_folder_needed(self.lora))
        self.folder = Path(options.get("sync_folder") or ".")
        self.token = client_token(options.get("sync_folder"), options.get("token_file"))  # as the server has it
        self.version = 0
        self.requests = ThreadPoolExecutor(1, thread_name_prefix="rlhf-lab-generate")  # submit's requests
        self.group: WeightGroup | None = None
        if collective and distributed.is_main_process():
            self._open_group(str(options.get("group_host") or "127.0.0.1"), int(options.get("group_port") or 29650))
        self.collective = collective
        # generation.weight_updates in_flight / partial: each version the trainer publishes lands between two decode
        # steps of the request in progress (the server's --engine hf stages it), and each token comes back with its
        # version; batch: between requests, every token of a request from one version.
        updates = options.get("weight_updates", "batch")
        self.in_flight, self.partial = updates != "batch", updates == "partial"
        self.publish_version: int | None = None  # the trainer's updates behind the next weights sent (the worker's)
        if self.in_flight:
            self._check_in_flight(updates)

    def _check_in_flight(self, updates: str) -> None:
        """The server must take loads between decode steps (both of ``rlhf-lab serve``'s engines stage them)."""
        try:
            health = _health(self.url, self.token)
        except (OSError, ValueError) as error:
            raise ConfigError(f"generation.url: no rlhf-lab serve answers at {self.url} ({error}); start one with "
                              "rlhf-lab serve MODEL --engine hf") from None
        if not health.get("in_flight"):
            raise ConfigError(f"generation.weight_updates={updates}: rlhf-lab serve at {self.url} takes weights "
                              "between requests only (its engine stages no load); start this rlhf-lab's serve (--engine hf or "
                              "vllm), or set "
                              "generation.weight_updates=batch")

    def _open_group(self, host: str, port: int) -> None:
        """Rank 0 and the server form their process group (rank 0 hosts its store; both join at once)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        joined = self.requests.submit(_post, f"{self.url}/open_group", {"host": host, "port": port,
                                                                        "backend": backend}, self.token)
        self.group = WeightGroup(host, port, 0, backend)
        joined.result()

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Samples:
        encoded, body = self._request(prompts, group_size, seeds, greedy, settings)
        return self.rollout(encoded, _post(f"{self.url}/generate", body, self.token), group_size)

    def submit(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
               settings: SamplingSettings | None = None) -> Callable[[], Samples]:
        """The request sent from a thread of its own: the server samples while the trainer trains, and the claim
        waits for its answer (the prompts are tokenised here, the rollout built by the claim, both in the
        trainer's thread)."""
        encoded, body = self._request(prompts, group_size, seeds, False, settings)
        reply = self.requests.submit(_post, f"{self.url}/generate", body, self.token)
        return lambda: self.rollout(encoded, reply.result(), group_size)

    def _request(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None, greedy: bool,
                 settings: SamplingSettings | None) -> tuple[list[list[int]], dict[str, Any]]:
        settings = settings or self.settings
        encoded = encode_prompts(self.tokenizer, prompts)
        return encoded, {
            "prompt_ids": encoded, "group_size": group_size, "seeds": seeds, "greedy": greedy,
            "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature, "top_p": settings.top_p,
            "top_k": settings.top_k, "max_prompt_tokens": settings.max_prompt_tokens, "stop": list(settings.stop),
            "in_flight": self.in_flight, "partial": self.partial}

    def rollout(self, encoded: list[list[int]], reply: dict[str, Any], group_size: int) -> Samples:
        """A reply's samples (``group_size`` per prompt of ``encoded``) as :class:`Samples`, with each token's version
        where the server takes weights in flight."""
        samples = [(encoded[i // group_size], tokens, logprobs) for i, (tokens, logprobs) in enumerate(reply["samples"])]
        rollout = samples_rollout(samples, group_size, self.tokenizer, self.device)
        if not self.in_flight:  # every token from the version the worker loaded for the request
            return rollout
        return replace(rollout, versions=token_versions(reply["versions"], rollout.response_mask))

    def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` to the server's ``route``, its reply (a stream of groups: :mod:`.served_groups`)."""
        return _post(f"{self.url}{route}", body, self.token)

    def health(self) -> dict[str, Any]:
        """The server's ``GET /health``."""
        return _health(self.url, self.token)

    def sync_weights(self, policy: nn.Module) -> None:
        """Rank 0 broadcasts each weight over the group as it is gathered (``collective``), or writes the weights
        (the adapter under LoRA) to the sync folder; the server loads them. Every rank takes part in gathering
        sharded weights and waits until the server has them."""
        self.version += 1
        folder = self.folder / f"v{self.version}"
        if self.collective:
            group = self.group  # rank 0's; the other ranks only gather
            loaded = (self.requests.submit(_post, f"{self.url}/receive_weights", self._label(), self.token)
                      if group is not None
                      else None)
            for name, tensor in streamed_state(policy):
                if group is not None:
                    group.send(hf_name(name), tensor)
            if group is not None and loaded is not None:
                group.end()
                self._fitting(loaded.result)
        elif self.lora:
            if distributed.is_main_process():
                policy.save_pretrained(folder)
                _post(f"{self.url}/load_adapter", {"folder": folder.name}, self.token)  # in the server's sync folder
        else:
            from safetensors.torch import save_file

            # Every rank gathers (FSDP needs all of them); only rank 0 keeps the full state, in host memory, and
            # writes it.
            main = distributed.is_main_process()
            state, stored = {}, set()
            for name, tensor in streamed_state(policy):
                if not main:
                    continue
                # A tied weight (the LM head) goes under each of its names (vLLM reloads layer by layer), each a
                # tensor of its own (safetensors refuses shared ones).
                shared = tensor.untyped_storage().data_ptr() in stored
                stored.add(tensor.untyped_storage().data_ptr())
                cast = self.wire_dtype if self.wire_dtype is not None and tensor.is_floating_point() else tensor.dtype
                state[hf_name(name)] = tensor.to("cpu", cast, copy=shared).contiguous()
            if main:
                folder.mkdir(parents=True, exist_ok=True)
                save_file(state, str(folder / "model.safetensors"))
                del state
                self._fitting(lambda: _post(f"{self.url}/load_weights", {"folder": folder.name, **self._label()},
                                            self.token))
        if distributed.is_main_process() and not self.collective:
            shutil.rmtree(self.folder / f"v{self.version - 1}", ignore_errors=True)
        distributed.barrier()

    def _label(self) -> dict[str, Any]:
        """The version the server knows the weights sent by: the trainer's updates behind them (the worker's)."""
        return {} if self.publish_version is None else {"version": self.publish_version}

    def _fitting(self, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``load()``; the server's refusal of weights its model cannot take is one line naming both models."""
        try:
            return load()
        except RuntimeError as error:
            if not any(words in str(error) for words in MISMATCH):
                raise
            mine = getattr(self.policy.config, "_name_or_path", "") or type(self.policy).__name__
            raise ConfigError(f"the trainer's model ({mine}) is not the one rlhf-lab serve at {self.url} serves "
                              f"({_served_model(self.url, self.token)}): {str(error).split(': ', 1)[-1]}; start the "
                              "server with the trainer's model") from None

    def close(self) -> None:
        """At the end of a run: the weights this run wrote to the sync folder removed (the server has loaded them;
        its token file stays, for the next run)."""
        if distributed.is_main_process() and not self.collective:
            shutil.rmtree(self.folder / f"v{self.version}", ignore_errors=True)

    def sleep(self, level: int = 2) -> None:
        """The server's memory is its own."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to take again."""
