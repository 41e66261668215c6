"""vLLM as a separate server (``rlhf-lab serve``) and its client engine (``generation=vllm_server``).

The server holds one vLLM engine (on its own GPUs, or this CPU) and answers JSON over HTTP:

- ``POST /generate``: prompts as token ids, samples per prompt, sampling settings, per-prompt seeds, stop
  strings, greedy -> the sampled token ids and the engine's log-probs;
- ``POST /load_weights``: the safetensors shards of a folder (full weights) become the engine's;
- ``POST /load_adapter``: a LoRA adapter folder becomes the one it samples with (the base weights stay);
- ``POST /open_group``: join the trainer's rank 0 in a process group of two (:mod:`.weight_group`);
- ``POST /receive_weights``: the full weights the trainer broadcasts over that group become the engine's;
- ``GET /health``.

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

import json
import os
import shutil
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_lab.config.choices import sync_folder_needed
from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.backend import Prompt, SamplingSettings, encode_prompts
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.generation.vllm import (
    IN_PROCESS,
    hf_name,
    import_vllm,
    lora_rank_slot,
    memory_settings,
    sampled_logprob,
    samples_rollout,
    sampling_params,
    streamed_state,
)
from rlhf_lab.generation.weight_group import WeightGroup
from rlhf_lab.registry import register
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.precision import Precision


# ------------------------------------------------------------------------------------------ the server
class _Engine:
    """The server's vLLM engine and what it samples with (weights, adapter), used by one request at a time."""

    def __init__(self, model: str, dtype: str, enforce_eager: bool, max_model_len: int, lora_rank: int) -> None:
        os.environ.setdefault(IN_PROCESS, "0")  # weights reach the engine by reference, in this process
        vllm = import_vllm()
        self.vllm, self.lock, self.adapter = vllm, threading.Lock(), None
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        kwargs = dict(model=model, tokenizer=model, dtype=dtype, enforce_eager=enforce_eager,
                      max_model_len=max_model_len, enable_prefix_caching=False, **memory_settings(device, {}))
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(lora_rank), max_loras=1)
        self.llm = vllm.LLM(**kwargs)
        self.adapter_version = 0
        self.group: WeightGroup | None = None  # the trainer's weights arrive over it (weight_sync=collective)

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        settings = SamplingSettings(request["max_new_tokens"], request["temperature"], request["top_p"],
                                    request["top_k"], request["max_prompt_tokens"], tuple(request.get("stop", ())))
        params = sampling_params(self.vllm, settings, request["group_size"], request.get("seeds"),
                                 request.get("greedy", False), len(request["prompt_ids"]))
        with self.lock:
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in request["prompt_ids"]], params,
                                        use_tqdm=False, lora_request=self.adapter)
        return {"samples": [[list(c.token_ids), [sampled_logprob(step, token) for step, token in
                                                  zip(c.logprobs or [], c.token_ids)]]
                            for output in outputs for c in output.outputs]}

    def load_weights(self, folder: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        with self.lock:
            weights = [item for shard in sorted(Path(folder).glob("*.safetensors"))
                       for item in load_file(str(shard)).items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
        return {"loaded": folder}

    def open_group(self, request: dict[str, Any]) -> dict[str, Any]:
        self.group = WeightGroup(request["host"], int(request["port"]), 1, request["backend"])
        return {"group": request["backend"]}

    def receive_weights(self) -> dict[str, Any]:
        if self.group is None:
            raise RuntimeError("no weight group: the trainer opens one first (POST /open_group)")
        with self.lock:
            weights = self.group.receive()
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
        return {"loaded": len(weights)}

    def load_adapter(self, folder: str) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        with self.lock:
            self.adapter_version += 1
            self.adapter = LoRARequest("policy", self.adapter_version, folder)
        return {"adapter": self.adapter_version}


def serve(model: str, host: str = "127.0.0.1", port: int = 8765, dtype: str = "float32", enforce_eager: bool = True,
          max_model_len: int = 2048, lora_rank: int = 0, ready: threading.Event | None = None) -> None:
    """Run the server until interrupted (``rlhf-lab serve``)."""
    engine = _Engine(model, dtype, enforce_eager, max_model_len, lora_rank)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": self.path})

        def do_POST(self) -> None:  # noqa: N802
            routes = {"/generate": engine.generate, "/load_weights": lambda r: engine.load_weights(r["folder"]),
                      "/load_adapter": lambda r: engine.load_adapter(r["folder"]), "/open_group": engine.open_group,
                      "/receive_weights": lambda r: engine.receive_weights()}
            if self.path not in routes:
                self._reply(404, {"error": f"no route {self.path}"})
                return
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            try:
                self._reply(200, routes[self.path](request))
            except Exception as error:  # the trainer gets the server's one line
                self._reply(500, {"error": f"{type(error).__name__}: {error}"})

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    print(f"rlhf-lab serve: {model} on http://{host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        server.serve_forever()
    finally:
        server.server_close()


# ------------------------------------------------------------------------------------------ the client engine

def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{url}: {json.loads(error.read()).get('error', error)}") from None
    except urllib.error.URLError as error:
        raise ConfigError(f"generation.url: no rlhf-lab serve answers at {url} ({error.reason}); start one with "
                          "rlhf-lab serve MODEL --port N") from None


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
        self.keep_logits = False
        self.url = str(options.get("url") or "http://127.0.0.1:8765").rstrip("/")
        self.lora = hasattr(policy, "peft_config")
        collective = options.get("weight_sync", "folder") == "collective" and not self.lora  # adapters: the folder
        if not collective and not options.get("sync_folder"):
            raise ConfigError(sync_folder_needed(self.lora))
        self.folder = Path(options.get("sync_folder") or ".")
        self.version = 0
        self.requests = ThreadPoolExecutor(1, thread_name_prefix="rlhf-lab-generate")  # submit's requests
        self.group: WeightGroup | None = None
        if collective and distributed.is_main_process():
            self._open_group(str(options.get("group_host") or "127.0.0.1"), int(options.get("group_port") or 29650))
        self.collective = collective

    def _open_group(self, host: str, port: int) -> None:
        """Rank 0 and the server form their process group (rank 0 hosts its store; both join at once)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        joined = self.requests.submit(_post, f"{self.url}/open_group", {"host": host, "port": port,
                                                                        "backend": backend})
        self.group = WeightGroup(host, port, 0, backend)
        joined.result()

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Rollout:
        encoded, body = self._request(prompts, group_size, seeds, greedy, settings)
        return self._rollout(encoded, _post(f"{self.url}/generate", body), group_size)

    def submit(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
               settings: SamplingSettings | None = None) -> Callable[[], Rollout]:
        """The request sent from a thread of its own: the server samples while the trainer trains, and the claim
        waits for its answer (the prompts are tokenised here, the rollout built by the claim, both in the
        trainer's thread)."""
        encoded, body = self._request(prompts, group_size, seeds, False, settings)
        reply = self.requests.submit(_post, f"{self.url}/generate", body)
        return lambda: self._rollout(encoded, reply.result(), group_size)

    def _request(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None, greedy: bool,
                 settings: SamplingSettings | None) -> tuple[list[list[int]], dict[str, Any]]:
        settings = settings or self.settings
        encoded = encode_prompts(self.tokenizer, prompts)
        return encoded, {
            "prompt_ids": encoded, "group_size": group_size, "seeds": seeds, "greedy": greedy,
            "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature, "top_p": settings.top_p,
            "top_k": settings.top_k, "max_prompt_tokens": settings.max_prompt_tokens, "stop": list(settings.stop)}

    def _rollout(self, encoded: list[list[int]], reply: dict[str, Any], group_size: int) -> Rollout:
        samples = [(encoded[i // group_size], tokens, logprobs) for i, (tokens, logprobs) in enumerate(reply["samples"])]
        return samples_rollout(samples, group_size, self.tokenizer, self.device)

    def sync_weights(self, policy: nn.Module) -> None:
        """Rank 0 broadcasts each weight over the group as it is gathered (``collective``), or writes the weights
        (the adapter under LoRA) to the sync folder; the server loads them. Every rank takes part in gathering
        sharded weights and waits until the server has them."""
        self.version += 1
        folder = self.folder / f"v{self.version}"
        if self.collective:
            group = self.group  # rank 0's; the other ranks only gather
            loaded = self.requests.submit(_post, f"{self.url}/receive_weights", {}) if group is not None else None
            for name, tensor in streamed_state(policy):
                if group is not None:
                    group.send(hf_name(name), tensor)
            if group is not None and loaded is not None:
                group.end()
                loaded.result()
        elif self.lora:
            if distributed.is_main_process():
                policy.save_pretrained(folder)
                _post(f"{self.url}/load_adapter", {"folder": str(folder)})
        else:
            from safetensors.torch import save_file

            state, stored = {}, set()
            for name, tensor in streamed_state(policy):
                # A tied weight (the LM head) goes under each of its names (vLLM reloads layer by layer), each a
                # tensor of its own (safetensors refuses shared ones).
                shared = tensor.untyped_storage().data_ptr() in stored
                stored.add(tensor.untyped_storage().data_ptr())
                state[hf_name(name)] = tensor.clone() if shared else tensor.contiguous()
            if distributed.is_main_process():
                folder.mkdir(parents=True, exist_ok=True)
                save_file(state, str(folder / "model.safetensors"))
                _post(f"{self.url}/load_weights", {"folder": str(folder)})
        if distributed.is_main_process() and not self.collective:
            shutil.rmtree(self.folder / f"v{self.version - 1}", ignore_errors=True)
        distributed.barrier()

    def sleep(self, level: int = 2) -> None:
        """The server's memory is its own."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to take again."""
