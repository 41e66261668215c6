"""The OpenAI-compatible routes of ``rlhf-lab serve``: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

An agent program written against the OpenAI client (a ``verifiers`` harness, LangGraph, …) can sample from the
served policy, and the trainer can still train on exactly what was sampled: like vLLM's OpenAI server, a request
with ``"return_token_ids": true`` gets the prompt's token ids (``prompt_token_ids``) and each choice's sampled ids
(``token_ids``); ``"logprobs": true`` (chat) or ``"logprobs": N`` (completions) gets the sampler's log-prob of
each sampled token, and ``"return_tokens_as_token_ids": true`` names each token ``token_id:ID`` instead of its
text. The field names and shapes are vLLM's (``vllm/entrypoints/openai/{chat_completion,completion}/protocol.py``).

The routes sit behind the server's trust rules (:mod:`.serving`): the token as ``Authorization: Bearer TOKEN``
(what OpenAI clients send as their API key), JSON bodies of a bounded size only; they read no path. They sample
with the engine the other routes load weights into (``--engine vllm`` or ``hf``), one request at a time.

Sampling: ``max_tokens`` (or ``max_completion_tokens``; default: the room left in ``--max-model-len``),
``temperature`` (0: greedy), ``top_p``, ``top_k`` (vLLM's extension; 0 or -1: off), ``n``, ``seed``, ``stop``. Each is
checked against its bounds (``MAX_N``, ``MAX_STOP``, ``MAX_LOGPROBS``, the int64 seed, the vocabulary for token-id
prompts) and a bad one is a 400 naming it; a null field takes its default, and 0 is never read as "unset".
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_lab.generation.serve_token import RequestError

MAX_N = 64  # samples per prompt of one request
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's limit on stop sequences; each one's length (its setup grows with both)
MAX_LOGPROBS = 20  # completions' logprobs and chat's top_logprobs (OpenAI's 0-20 for chat; vLLM's default max_logprobs)


def _error(message: str, status: int = 400) -> Exception:
    return RequestError(status, message)


class OpenAIRoutes:
    """The two routes over ``server``'s engine (a :class:`~.serving.WeightServer`: its engine, its lock); the tokenizer (chat template, text) is the model folder's, read at
    the first request (``tokenizer`` given: that one)."""

    def __init__(self, server: Any, model: str, max_model_len: int, tokenizer: Any = None,
                 served_name: str | None = None) -> None:
        self.server, self.model, self.max_model_len = server, model, max_model_len
        self.served_name = served_name or model
        self._tokenizer = tokenizer
        self.routes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "/v1/chat/completions": self.chat, "/v1/completions": self.completions}
        self.get_routes: dict[str, Callable[[], dict[str, Any]]] = {"/v1/models": self.models}
        # The names a request's ``model`` may give: the launch path, the folder's name, the path resolved.
        self.names = [self.served_name]
        for alias in (Path(model).name, str(Path(model).expanduser().resolve())):
            if alias and alias not in self.names:
                self.names.append(alias)

    def models(self) -> dict[str, Any]:
        """``GET /v1/models`` as OpenAI's and vLLM's servers answer it (clients probe it first): the served model
        under each name a request may give."""
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rlhf-lab",
                                            "root": self.served_name, "max_model_len": self.max_model_len}
                                           for name in self.names]}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model)
            except (OSError, ValueError) as error:
                raise _error(f"the served model {self.model!r} has no tokenizer to read ({type(error).__name__}); "
                             "save one beside its weights (tokenizer.save_pretrained)", 500) from None
        return self._tokenizer

    # -------------------------------------------------------------------------------------------- the routes
    def chat(self, request: dict[str, Any]) -> dict[str, Any]:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _error("messages must be a non-empty list of {role, content} objects")
        try:
            prompt = list(self.tokenizer.apply_chat_template(messages, tools=request.get("tools"), tokenize=True,
                                                             add_generation_prompt=True, return_dict=True)["input_ids"])
        except Exception as error:  # a template's own refusal (a role it does not know, ...)
            raise _error(f"the chat template refused the messages ({type(error).__name__}: {error})") from None
        top_logprobs = request.get("top_logprobs")
        if not isinstance(request.get("logprobs", False), bool | None):
            raise _error("logprobs must be true or false")
        if top_logprobs is not None and not (_integer(top_logprobs) and 0 <= top_logprobs <= MAX_LOGPROBS):
            raise _error(f"top_logprobs must be an integer 0-{MAX_LOGPROBS}")
        samples, finish = self._sample([prompt], request)
        want_ids, want_logprobs = bool(request.get("return_token_ids")), bool(request.get("logprobs"))
        choices = []
        for index, (tokens, logprobs) in enumerate(samples):
            content = [{"token": name, "logprob": logprob, "bytes": list(name.encode()), "top_logprobs": []}
                       for name, logprob in zip(self._names(tokens, request), logprobs)]
            choices.append({"index": index, "message": {"role": "assistant", "content": self._text(tokens)},
                            "logprobs": {"content": content} if want_logprobs else None,
                            "finish_reason": finish[index], "stop_reason": None,
                            "token_ids": tokens if want_ids else None})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": _usage([prompt], samples),
                "prompt_token_ids": prompt if want_ids else None}

    def completions(self, request: dict[str, Any]) -> dict[str, Any]:
        prompts = self._prompts(request.get("prompt"))
        logprobs_asked = request.get("logprobs")
        if logprobs_asked is not None and not (_integer(logprobs_asked) and 0 <= logprobs_asked <= MAX_LOGPROBS):
            raise _error(f"logprobs must be an integer 0-{MAX_LOGPROBS}")
        samples, finish = self._sample(prompts, request)
        want_ids, logprobs_asked = bool(request.get("return_token_ids")), request.get("logprobs")
        n = len(samples) // len(prompts)
        choices = []
        for index, (tokens, logprobs) in enumerate(samples):
            names = self._names(tokens, request)
            offsets = [sum(len(self._text([t])) for t in tokens[:i]) for i in range(len(tokens))]
            choices.append({
                "index": index, "text": self._text(tokens),
                "logprobs": None if logprobs_asked is None or logprobs_asked is False else {
                    "text_offset": offsets, "token_logprobs": logprobs, "tokens": names,
                    "top_logprobs": [{name: logprob} for name, logprob in zip(names, logprobs)]},
                "finish_reason": finish[index], "stop_reason": None,
                "token_ids": tokens if want_ids else None,
                "prompt_token_ids": prompts[index // n] if want_ids else None})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": _usage(prompts, samples)}

    # -------------------------------------------------------------------------------------------- shared
    def _prompts(self, prompt: Any) -> list[list[int]]:
        """``prompt`` as token id lists: a string, a list of strings, a list of ids, or a list of id lists."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise _error("prompt must be a string, a list of strings, or token ids")
        out = []
        for item in prompt:
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=False)["input_ids"]
                if not ids:
                    raise _error("prompt must not be empty")
                out.append(ids)
            elif isinstance(item, list) and item and all(_integer(t) for t in item):
                vocabulary = len(self.tokenizer)
                if not all(0 <= t < vocabulary for t in item):
                    raise _error(f"prompt token ids must be in 0-{vocabulary - 1} (the served model's vocabulary)")
                out.append(list(item))
            else:
                raise _error("prompt must be a string, a list of strings, or token ids")
        return out

    def _sample(self, prompts: list[list[int]], request: dict[str, Any]) -> tuple[list[list[Any]], list[str]]:
        model = request.get("model")
        if model is not None and model not in self.names:
            raise _error(f"model {model!r} is not served here; this server serves {self.served_name!r} (also known "
                         f"as {', '.join(repr(name) for name in self.names[1:]) or 'nothing else'})", 404)
        longest = max(map(len, prompts))
        room = self.max_model_len - longest
        if room <= 0:
            raise _error(f"the prompt is {longest} tokens, no room left in --max-model-len {self.max_model_len}")
        max_tokens = _given(request, "max_tokens", _given(request, "max_completion_tokens", room))
        n, temperature = _given(request, "n", 1), _given(request, "temperature", 1.0)
        top_p, top_k, seed = _given(request, "top_p", 1.0), _given(request, "top_k", 0), request.get("seed")
        stop = _given(request, "stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        strings = isinstance(stop, list) and all(isinstance(s, str) for s in stop)
        checks = [(_integer(max_tokens) and 0 < max_tokens <= room, f"max_tokens must be 1-{room}"),
                  (_integer(n) and 0 < n <= MAX_N, f"n must be 1-{MAX_N}"),
                  (_number(temperature) and temperature >= 0, "temperature must be a finite number >= 0"),
                  (_number(top_p) and 0 < top_p <= 1, "top_p must be in (0, 1]"),
                  (_integer(top_k) and top_k >= -1, "top_k must be an integer >= -1 (0 or -1: off)"),
                  (seed is None or (_integer(seed) and seed >= -(2**63) and seed + len(prompts) <= 2**63),
                   "seed must be an integer in [-2**63, 2**63 - 1]"),
                  (strings, "stop must be strings"),
                  (not strings or (len(stop) <= MAX_STOP and all(0 < len(s) <= MAX_STOP_CHARS for s in stop)),
                   f"stop must be at most {MAX_STOP} strings of 1-{MAX_STOP_CHARS} characters")]
        for ok, message in checks:
            if not ok:
                raise _error(message)
        body = {"prompt_ids": prompts, "group_size": n, "max_new_tokens": max_tokens,
                "temperature": float(temperature) or 1.0, "top_p": float(top_p), "top_k": max(top_k, 0),
                "max_prompt_tokens": longest, "stop": stop, "greedy": temperature == 0,
                "seeds": None if seed is None else [seed + i for i in range(len(prompts))]}
        with self.server.lock:
            samples = self.server.engine.generate(body)
        eos = self.tokenizer.eos_token_id
        finish = ["stop" if tokens and (tokens[-1] == eos or len(tokens) < max_tokens) else "length"
                  for tokens, _ in samples]
        return [[list(tokens), [float(x) for x in logprobs]] for tokens, logprobs in samples], finish

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _names(self, tokens: list[int], request: dict[str, Any]) -> list[str]:
        if request.get("return_tokens_as_token_ids"):
            return [f"token_id:{token}" for token in tokens]
        return [self.tokenizer.decode([token]) for token in tokens]


def _given(request: dict[str, Any], key: str, default: Any) -> Any:
    """``request[key]``, ``default`` where it is absent or null (never where it is 0 or empty: those are checked)."""
    value = request.get(key)
    return default if value is None else value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_generate(request: dict[str, Any], vocabulary: int | None) -> dict[str, Any]:
    """The internal ``/generate`` route's body (the trainer's :class:`~rlhf_lab.generation.server.VLLMServerGeneration`
    sends it): every field within the bounds the OpenAI routes keep, else a 400 naming it; ``top_k=-1`` is "off" as
    in vLLM. ``vocabulary``: the served model's token count (None: unknown). Returns the body to sample."""
    prompts, seeds, stop = request["prompt_ids"], request.get("seeds"), request.get("stop") or []
    top_k = request["top_k"]
    checks = [
        (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p and all(map(_integer, p))
                                                       for p in prompts), "prompt_ids must be non-empty token id lists"),
        (_integer(request["group_size"]) and 0 < request["group_size"] <= MAX_N, f"group_size must be 1-{MAX_N}"),
        (_integer(request["max_new_tokens"]) and request["max_new_tokens"] > 0, "max_new_tokens must be an integer >= 1"),
        (_integer(request["max_prompt_tokens"]) and request["max_prompt_tokens"] > 0,
         "max_prompt_tokens must be an integer >= 1"),
        (_number(request["temperature"]) and request["temperature"] > 0, "temperature must be a finite number > 0"),
        (_number(request["top_p"]) and 0 < request["top_p"] <= 1, "top_p must be in (0, 1]"),
        (_integer(top_k) and top_k >= -1, "top_k must be an integer >= -1 (0 or -1: off)"),
        (isinstance(request.get("greedy", False), bool), "greedy must be true or false"),
        (seeds is None or (isinstance(seeds, list) and isinstance(prompts, list) and len(seeds) == len(prompts)
                           and all(_integer(x) and -(2**63) <= x < 2**63 for x in seeds)),
         "seeds must be null or one integer in [-2**63, 2**63 - 1] per prompt"),
        (isinstance(stop, list) and len(stop) <= MAX_STOP
         and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop),
         f"stop must be at most {MAX_STOP} strings of 1-{MAX_STOP_CHARS} characters"),
    ]
    for ok, message in checks:
        if not ok:
            raise _error(message)
    if vocabulary is not None and not all(0 <= t < vocabulary for p in prompts for t in p):
        raise _error(f"prompt token ids must be in 0-{vocabulary - 1} (the served model's vocabulary)")
    return {**request, "top_k": max(top_k, 0), "stop": stop}


def _usage(prompts: list[list[int]], samples: list[list[Any]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(tokens) for tokens, _ in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
