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
``temperature`` (0: greedy), ``top_p``, ``top_k`` (vLLM's extension; 0 or -1: off), ``n``, ``seed``, ``stop``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from rlhf_lab.generation.serve_engine import RequestError


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
                out.append(self.tokenizer(item, add_special_tokens=False)["input_ids"])
            elif isinstance(item, list) and item and all(isinstance(t, int) and t >= 0 for t in item):
                out.append(list(item))
            else:
                raise _error("prompt must be a string, a list of strings, or token ids")
        return out

    def _sample(self, prompts: list[list[int]], request: dict[str, Any]) -> tuple[list[list[Any]], list[str]]:
        model = request.get("model")
        if model is not None and model != self.served_name:
            raise _error(f"model {model!r} is not served here; this server serves {self.served_name!r}", 404)
        longest = max(map(len, prompts))
        room = self.max_model_len - longest
        if room <= 0:
            raise _error(f"the prompt is {longest} tokens, no room left in --max-model-len {self.max_model_len}")
        max_tokens = request.get("max_tokens", request.get("max_completion_tokens")) or room
        n, temperature = request.get("n") or 1, request.get("temperature", 1.0)
        top_p, top_k, seed = request.get("top_p", 1.0), request.get("top_k") or 0, request.get("seed")
        stop = request.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        checks = [(isinstance(max_tokens, int) and 0 < max_tokens <= room, f"max_tokens must be 1-{room}"),
                  (isinstance(n, int) and 0 < n <= 64, "n must be 1-64"),
                  (isinstance(temperature, (int, float)) and temperature >= 0, "temperature must be >= 0"),
                  (isinstance(top_p, (int, float)) and 0 < top_p <= 1, "top_p must be in (0, 1]"),
                  (isinstance(top_k, int), "top_k must be an integer"),
                  (seed is None or isinstance(seed, int), "seed must be an integer"),
                  (isinstance(stop, list) and all(isinstance(s, str) for s in stop), "stop must be strings")]
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


def _usage(prompts: list[list[int]], samples: list[list[Any]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(tokens) for tokens, _ in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
