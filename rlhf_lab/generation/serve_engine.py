"""The engine behind ``rlhf-lab serve`` (:mod:`.serving`): what the server needs of one, vLLM's, and the checks
made before it is built (the dtype the device can run) or before it takes weights (the model's own names and
shapes)."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf_lab.errors import ToolError
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.serve_token import RequestError
from rlhf_lab.generation.vllm import IN_PROCESS, import_vllm, lora_rank_slot, sampled_logprob, sampling_params

DEFAULT_MEMORY_SHARE = 0.3  # of an 80 GB GPU: a 7B policy's bf16 weights (~14 GB) and ~10 GB of KV cache
DTYPES = ("auto", "float32", "bfloat16", "float16")
REQUEST_SECONDS = 600.0  # ``--engine hf``: the longest one request may sample before it is stopped (408)


class ServerEngine(Protocol):
    """What the server needs of an engine (one request at a time; the server holds the lock)."""

    def generate(self, request: dict[str, Any]) -> list[list[list[Any]]]:
        """Per sample (prompt-major, ``group_size`` each): [token ids, their log-probs]."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Take the weights as they come, one at a time (never all on the device at once); returns how many."""

    def set_adapter(self, folder: str | None, version: int) -> None:
        """Sample with the LoRA adapter in ``folder`` from now on (None: the base weights)."""


class StagedLoads:
    """Weights that land between two decode steps (in flight): a load is staged from the server's thread and the
    decode lets it land at its next step, or the server at once where no request is in progress. An engine says
    how it takes one (:meth:`take`); :attr:`sample_versions` says which version sampled each token of its last
    request."""

    def _start_staging(self) -> None:
        self.version = 0  # the trainer's label of the weights it samples with now (sent with each load)
        # Loads waiting for the decode's next step, oldest first: (weights, version, set once they are in).
        self.staged: list[tuple[dict[str, torch.Tensor], int, threading.Event]] = []
        self.staging = threading.Lock()
        self.sample_versions: list[list[int]] = []  # per sample of the last request: each token's version

    def take(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Copy ``weights`` into the engine's model (the engine's own)."""
        raise NotImplementedError

    def stage(self, weights: dict[str, torch.Tensor], version: int) -> threading.Event:
        """Full weights that land at the next decode step of the request in progress, or at the next :meth:`land`
        when none is; the event is set once they are in."""
        landed = threading.Event()
        with self.staging:
            self.staged.append((weights, version, landed))
        return landed

    def land(self) -> bool:
        """Every staged load taken into the model, oldest first (the caller holds the server's lock, or is the
        decode between two steps); True where one landed."""
        with self.staging:
            staged, self.staged = self.staged, []
        for weights, version, landed in staged:
            try:
                self.take(weights, version)
                self.version = version
            finally:
                landed.set()
        return bool(staged)


class VLLMServerEngine(StagedLoads):
    """vLLM's engine for the server: in process, its dtype and memory share as given. Its requests are stepped here,
    one engine step at a time, so a staged load can land between two decode steps: in flight, the requests go on with
    the key/value cache of the older weights; under ``partial`` (a field of the request) each unfinished request is
    stopped and sent again with its tokens so far as prompt, prefilled by the new weights, and goes on from there
    (its seed moved on by its length; a stop string that would straddle the two parts is not seen)."""

    def __init__(self, model: str, dtype: str, enforce_eager: bool, max_model_len: int, lora_rank: int,
                 memory_share: float = DEFAULT_MEMORY_SHARE, kv_cache_mib: int = 512) -> None:
        os.environ.setdefault(IN_PROCESS, "0")  # weights reach the engine by reference; one step per step() call
        self.vllm = import_vllm()
        memory = ({"gpu_memory_utilization": memory_share} if torch.cuda.is_available()
                  else {"kv_cache_memory_bytes": kv_cache_mib << 20})
        # As the in-process engine (generation/vllm.py): the sampled tokens' log-probs after temperature and
        # top-k/top-p, and a group's shared prompt prefilled once (a weight load resets the cache).
        kwargs = dict(model=model, tokenizer=model, dtype=dtype, enforce_eager=enforce_eager,
                      max_model_len=max_model_len, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                      **memory)
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(lora_rank), max_loras=1)
        self.llm, self.adapter = self.vllm.LLM(**kwargs), None
        self.vocabulary = len(self.llm.get_tokenizer())  # the token ids a request may send (/generate checks them)
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self._start_staging()
        self.requests = itertools.count()  # request ids, unique over the engine's life
        self.decoding = False  # a request is in progress (its blocks are in use: the prefix cache is reset after it)
        self.between_steps: Callable[[int], None] | None = None  # called after each engine step (tests script it)

    def generate(self, request: dict[str, Any]) -> list[list[list[Any]]]:
        """The request's samples, each a request of its own (the n samples of a prompt with seeds seed, seed + 1,
        ... as vLLM's own fan-out gives them), stepped until all are done. Where the request says ``in_flight``,
        loads staged meanwhile land between two steps, else after it; the tokens of each step carry the version
        that sampled them."""
        settings = SamplingSettings(request["max_new_tokens"], request["temperature"], request["top_p"],
                                    request["top_k"], request["max_prompt_tokens"], tuple(request.get("stop", ())))
        group = request["group_size"]
        params = sampling_params(self.vllm, settings, group, request.get("seeds"), request.get("greedy", False),
                                 len(request["prompt_ids"]))
        self.land()
        engine, in_flight, partial = (self.llm.llm_engine, bool(request.get("in_flight", False)),
                                      bool(request.get("partial", False)))
        samples: list[list[list[Any]]] = [[[], [], []] for _ in range(len(params) * group)]  # ids, log-probs, versions
        live: dict[str, tuple[int, list[int], Any]] = {}  # request id -> (sample, prompt ids, its sampling params)

        def send(index: int, prompt: list[int], child: Any) -> None:
            child.output_kind = self.vllm.sampling_params.RequestOutputKind.DELTA  # each step's new tokens
            rid = f"{next(self.requests)}"
            live[rid] = (index, prompt, child)
            engine.add_request(rid, {"prompt_token_ids": prompt}, child, lora_request=self.adapter)

        for i, (prompt, prompt_params) in enumerate(zip(request["prompt_ids"], params)):
            for j in range(group):
                child = prompt_params.clone()
                child.n, child.seed = 1, None if prompt_params.seed is None else prompt_params.seed + j
                send(i * group + j, list(prompt), child)
        self.decoding, landed, step = True, False, 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    index = live[output.request_id][0]
                    for completion in output.outputs:
                        ids, logprobs, versions = samples[index]
                        ids += completion.token_ids
                        logprobs += [sampled_logprob(at, token) for at, token in
                                     zip(completion.logprobs or [], completion.token_ids)]
                        versions += [self.version] * len(completion.token_ids)
                    if output.finished:
                        del live[output.request_id]
                step += 1
                if self.between_steps is not None:
                    self.between_steps(step)
                if in_flight and self.land():
                    landed = True
                    if partial and live:
                        self._resume(live, samples, settings.max_new_tokens, send)
        finally:
            self.decoding = False
            if landed:  # blocks prefilled by older weights are no prompt's prefix now
                self.llm.reset_prefix_cache()
        self.sample_versions = [versions for _, _, versions in samples]
        return [[ids, logprobs] for ids, logprobs, _ in samples]

    def _resume(self, live: dict[str, tuple[int, list[int], Any]], samples: list[list[list[Any]]], most: int,
                send: Callable[[int, list[int], Any], None]) -> None:
        """A partial rollout: every unfinished request stopped and sent again with its tokens so far as prompt, with
        the new weights' cache (the prefix cache emptied first: the prompts' blocks are the old weights')."""
        stopped = dict(live)
        self.llm.llm_engine.abort_request(list(stopped))
        live.clear()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after every request stopped; a partial rollout would "
                               "reuse the older weights' keys and values")
        for index, prompt, child in stopped.values():
            done = samples[index][0]
            resumed = child.clone()
            resumed.max_tokens, resumed.min_tokens = most - len(done), 0 if done else 1
            resumed.seed = None if child.seed is None else (child.seed + 7919 * len(done)) % 2**31
            send(index, prompt + done, resumed)

    def take(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self._reload(weights.items())
        self.llm.llm_engine.set_weight_version(str(version))  # vLLM's own spans (CompletionOutput.weight_versions)

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload, one weight at a time as they come (a tied head given where it is missing)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._with_head(weights),
                                                          "is_checkpoint_format": True})

    def _with_head(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights, and where the model ties its LM head to the embedding and they hold the embedding only (a
        folder ``save_pretrained`` wrote), the embedding again as the head: vLLM's in-place reload goes layer by
        layer and leaves a head it is not sent as it was."""
        head, embedding = False, None
        for name, tensor in weights:
            head = head or name.endswith("lm_head.weight")
            embedding = tensor if name.endswith("embed_tokens.weight") else embedding
            yield name, tensor
        if self.tied and embedding is not None and not head:
            yield "lm_head.weight", embedding

    def land(self) -> bool:
        landed = super().land()
        if landed and not self.decoding:
            self.llm.reset_prefix_cache()
        return landed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        counted = _Counted(weights)
        self._reload(counted)
        self.llm.reset_prefix_cache()
        return counted.count

    def set_adapter(self, folder: str | None, version: int) -> None:
        self.adapter = None if folder is None else self.vllm.lora.request.LoRARequest("policy", version, folder)
        self.llm.reset_prefix_cache()  # prompts cached under the previous adapter


class _Counted:
    """An iterator over weights that counts what went through it."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights, self.count = iter(weights), 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.weights:
            self.count += 1
            yield item


def weight_names(handle: Any) -> list[str]:
    """The names in an open safetensors file (``safe_open`` has no ``__iter__``)."""
    return list(handle.keys())


def checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight in the model folder's safetensors (headers only); {} for a hub id."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []:
        with safe_open(str(shard), "pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in weight_names(handle)})
    return shapes


def check_dtype(dtype: str, cuda: bool) -> str:
    """The engine's dtype: ``auto`` follows the trainer's default precision (bf16 on a GPU that runs it, fp32 on a
    CPU); one the device cannot run is one line."""
    if dtype not in DTYPES:
        raise ToolError(f"--dtype {dtype!r} is not valid; choose from: {', '.join(DTYPES)}")
    # Natively (compute capability 8.0 and later): vLLM refuses bfloat16 where torch would only emulate it.
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if dtype == "auto":
        return ("bfloat16" if bf16 else "float16") if cuda else "float32"
    if dtype == "bfloat16" and cuda and not bf16:
        raise ToolError("--dtype bfloat16: this GPU cannot run bfloat16; use --dtype float16 (or auto)")
    if dtype == "float16" and not cuda:
        raise ToolError("--dtype float16: vLLM's CPU backend runs float32 or bfloat16; use --dtype float32 (or auto)")
    return dtype


def check_start(model: str, host: str, port: int) -> None:
    """One line, before any model loads, where the server could not start: a port outside 0-65535 or one this
    machine will not let it listen on (in use, privileged), or a model path that does not exist. A name that may be
    a hub id (``org/name``) is left to the engine."""
    if not 0 <= port <= 65535:
        raise ToolError(f"--port {port}: a TCP port is 0-65535 (0: any free one)")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
            probe.bind((host, port))
    except OSError as error:
        raise ToolError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error}); choose "
                        "another --port (0: any free one)") from None
    local = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if local and not Path(model).expanduser().exists():
        raise ToolError(f"MODEL {model!r} does not exist; give a folder save_pretrained wrote (or a hub id)")


def sample_request(engine: Any, request: dict[str, Any]) -> list[list[list[Any]]]:
    """A server's generate request sampled by a generation engine (``generate(prompts, group_size, seeds, greedy,
    settings) -> Rollout``): [sampled ids, their log-probs] per sample, prompt-major."""
    settings = SamplingSettings(request["max_new_tokens"], request["temperature"], request["top_p"],
                                request["top_k"], request["max_prompt_tokens"], tuple(request.get("stop", ())))
    rollout = engine.generate([list(ids) for ids in request["prompt_ids"]], request["group_size"],
                              request.get("seeds"), request.get("greedy", False), settings)
    responses = rollout.input_ids[:, rollout.prompt_width:].tolist()
    lengths = rollout.response_mask.sum(-1).long().tolist()
    return [[tokens[:n], logprobs[:n]] for tokens, logprobs, n in zip(responses, rollout.logprobs.tolist(), lengths)]


class HFServerEngine(StagedLoads):
    """The server's engine without vLLM (``rlhf-lab serve --engine hf``): the model folder's transformers model,
    sampled by the ``hf`` generation engine (:class:`~rlhf_lab.generation.hf.HFGeneration`); weights load by name
    into its parameters. Slower than vLLM, but it needs no extra and samples exactly as ``generation=hf`` does."""

    def __init__(self, model: str, dtype: str, enforce_eager: bool = True, max_model_len: int = 2048,
                 lora_rank: int = 0, memory_share: float = DEFAULT_MEMORY_SHARE, kv_cache_mib: int = 512) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_lab.generation.hf import HFGeneration

        if lora_rank:
            raise ToolError("--engine hf serves full weights only; give --lora-rank 0, or --engine vllm for adapters")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.engine = HFGeneration(self.model, self.tokenizer, SamplingSettings(1, 1.0, 1.0, 0, max_model_len),
                                   keep_logits=False)
        self.vocabulary = len(self.tokenizer)  # the token ids a request may send (the /generate route checks them)
        self.request_seconds = REQUEST_SECONDS  # ``--request-seconds``: one request's sampling budget
        self._start_staging()

    def generate(self, request: dict[str, Any]) -> list[list[list[Any]]]:
        """The request's samples. Where the request says ``in_flight``, weights staged meanwhile land between two
        decode steps (the key/value cache of the older weights kept; ``partial`` too: recomputed with the new ones),
        else after it; and
        :attr:`sample_versions` says which version sampled each token (the samples decode in step). A 408 where the
        decode runs past ``request_seconds`` (checked between decode steps: the engine is free again at once,
        nothing returned)."""
        deadline = time.monotonic() + self.request_seconds
        in_flight, partial = bool(request.get("in_flight", False)), bool(request.get("partial", False))
        self.land()
        versions = [self.version]

        def between(step: int) -> bool:
            if time.monotonic() >= deadline:
                raise RequestError(408, f"the request sampled for longer than the server's --request-seconds="
                                        f"{self.request_seconds:g} (stopped at token {step}); ask for fewer tokens "
                                        "or samples per request")
            landed = in_flight and self.land()
            versions.append(self.version)
            return landed and partial

        self.engine.between_steps = between
        try:
            samples = sample_request(self.engine, request)
        finally:
            self.engine.between_steps = None
        self.sample_versions = [[versions[min(t, len(versions) - 1)] for t in range(len(ids))] for ids, _ in samples]
        return samples

    def stage(self, weights: dict[str, torch.Tensor], version: int) -> threading.Event:
        """As :meth:`StagedLoads.stage`, the weights checked against the model's names and shapes first."""
        own = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in weights.items():
            if name not in own:
                raise KeyError(f"weight {name!r} is not one of the served model's")
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"weight {name!r} has shape {list(tensor.shape)}, the model's is "
                                 f"{list(own[name].shape)}")
        return super().stage(weights, version)

    def take(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.load_weights(weights.items())
        torch.clear_autocast_cache()  # under autocast the casts of the weights are cached per tensor, not per value

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        own = dict(self.model.named_parameters(remove_duplicate=False))
        count = 0
        with torch.no_grad():
            for name, tensor in weights:
                if name not in own:
                    raise KeyError(f"weight {name!r} is not one of the served model's")
                own[name].copy_(tensor)
                count += 1
        return count

    def set_adapter(self, folder: str | None, version: int) -> None:
        if folder is not None:
            raise ToolError("--engine hf serves full weights only; LoRA adapters need --engine vllm")
