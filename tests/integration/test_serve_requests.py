"""Every bad request to the OpenAI routes of ``rlhf-lab serve`` is a 400 in one line naming the field and its
bounds, never a 500 and never a value silently read as another (rlhf_lab/generation/openai_routes.py): request by
request as the audit sent them, then a seeded fuzz over the request schema."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_serve_openai import MESSAGES, call, model_folder, server  # noqa: F401  (fixtures)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(("route", "field", "value", "message"), [
    (COMPLETIONS, "n", 0, "n must be 1-64"),
    (COMPLETIONS, "n", 65, "n must be 1-64"),
    (COMPLETIONS, "n", True, "n must be 1-64"),
    (COMPLETIONS, "max_tokens", 0, "max_tokens must be 1-"),
    (CHAT, "max_completion_tokens", 0, "max_tokens must be 1-"),
    (COMPLETIONS, "temperature", float("inf"), "temperature must be a finite number >= 0"),
    (COMPLETIONS, "temperature", float("nan"), "temperature must be a finite number >= 0"),
    (CHAT, "temperature", -0.5, "temperature must be a finite number >= 0"),
    (COMPLETIONS, "seed", 2**70, "seed must be an integer in [-2**63, 2**63 - 1]"),
    (COMPLETIONS, "seed", "7", "seed must be an integer in [-2**63, 2**63 - 1]"),
    (COMPLETIONS, "top_k", -2, "top_k must be an integer >= -1 (0 or -1: off)"),
    (COMPLETIONS, "top_p", 0, "top_p must be in (0, 1]"),
    (COMPLETIONS, "logprobs", -1, "logprobs must be an integer 0-20"),
    (COMPLETIONS, "logprobs", 1000, "logprobs must be an integer 0-20"),
    (COMPLETIONS, "logprobs", "many", "logprobs must be an integer 0-20"),
    (CHAT, "top_logprobs", 50, "top_logprobs must be an integer 0-20"),
    (CHAT, "top_logprobs", -2, "top_logprobs must be an integer 0-20"),
    (CHAT, "logprobs", 3, "logprobs must be true or false"),
    (COMPLETIONS, "stop", [""], "stop must be at most 4 strings of 1-256 characters"),
    (COMPLETIONS, "stop", ["a"] * 5, "stop must be at most 4 strings of 1-256 characters"),
    (COMPLETIONS, "stop", ["x" * 257], "stop must be at most 4 strings of 1-256 characters"),
    (COMPLETIONS, "stop", [3], "stop must be strings"),
    (COMPLETIONS, "prompt", "", "prompt must not be empty"),
    (COMPLETIONS, "prompt", [5, 10**9, 7], "prompt token ids must be in 0-"),
    (COMPLETIONS, "prompt", [5, -1, 7], "prompt token ids must be in 0-"),
    (COMPLETIONS, "prompt", [], "prompt must be a string, a list of strings, or token ids"),
])
def test_a_bad_field_is_a_400_naming_it(server, model_folder: Path, route: str, field: str, value: Any,  # noqa: F811
                                        message: str) -> None:
    url, token, _ = server
    body = {"model": str(model_folder), **({"messages": MESSAGES} if route == CHAT else {"prompt": "Hello"}),
            **({} if field.startswith("max_") else {"max_tokens": 2}), field: value}
    status, reply = call(url, route, body, token)
    assert status == 400, reply
    assert reply["error"].startswith(message) and "\n" not in reply["error"], reply


def test_null_fields_take_their_defaults_and_limits_are_served(server, model_folder: Path) -> None:  # noqa: F811
    url, token, _ = server
    status, reply = call(url, COMPLETIONS, {"prompt": "Hello", "max_tokens": 3, "n": None, "temperature": None,
                                            "top_k": -1, "logprobs": 20, "stop": ["a", "b", "c", "d"],
                                            "seed": -(2**63)}, token)
    assert status == 200, reply
    assert len(reply["choices"]) == 1 and len(reply["choices"][0]["logprobs"]["token_logprobs"]) <= 3


def fuzz_value(rng: random.Random) -> Any:
    return rng.choice([None, 0, 1, -1, 2, 7, 2**63, -(2**64), 0.5, 1.5, -0.1, float("inf"), float("-inf"), True,
                       False, "", "x", "many", [], [""], ["stop"], [1, 2], {"a": 1}, "x" * 300])


def test_fuzzed_requests_are_answered_200_or_4xx_in_one_line(server, model_folder: Path) -> None:  # noqa: F811
    """200 requests whose every field is drawn from valid and invalid values alike (seeded): each answer is 200, or
    4xx with a one-line error; the server answers the last one as it answered the first."""
    url, token, _ = server
    rng = random.Random(0)
    fields = ["n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
              "logprobs", "top_logprobs", "return_token_ids", "return_tokens_as_token_ids", "model"]
    answered = {}
    for index in range(200):
        route = rng.choice([CHAT, COMPLETIONS])
        body: dict[str, Any] = {"max_tokens": rng.choice([1, 2])}
        if route == CHAT:
            body["messages"] = rng.choice([MESSAGES, [], "hi", [{"role": "user", "content": "Hi"}]])
        else:
            body["prompt"] = rng.choice(["Hello", "", [5, 6], [[5, 6], [7]], [5, 10**9], "x" * 50])
        for name in rng.sample(fields, rng.randint(0, 4)):
            body[name] = fuzz_value(rng)
        status, reply = call(url, route, body, token)
        assert status == 200 or 400 <= status < 500, (index, body, status, reply)
        if status != 200:
            assert isinstance(reply["error"], str) and "\n" not in reply["error"], (body, reply)
        answered[status] = answered.get(status, 0) + 1
    assert answered.get(200, 0) > 10 and answered.get(400, 0) > 10, answered  # both kinds were drawn
    assert call(url, COMPLETIONS, {"prompt": "Hello", "max_tokens": 1}, token)[0] == 200


GENERATE = {"prompt_ids": [[5, 6, 7]], "group_size": 1, "max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "max_prompt_tokens": 8, "seeds": [1], "greedy": False, "stop": []}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("top_k", -2, "top_k must be an integer >= -1 (0 or -1: off)"),
    ("top_k", 1.5, "top_k must be an integer >= -1"),
    ("temperature", float("inf"), "temperature must be a finite number > 0"),
    ("temperature", 0, "temperature must be a finite number > 0"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("group_size", 0, "group_size must be 1-64"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1"),
    ("max_prompt_tokens", "8", "max_prompt_tokens must be an integer >= 1"),
    ("seeds", [2**70], "seeds must be null or one integer in [-2**63, 2**63 - 1] per prompt"),
    ("seeds", [1, 2], "seeds must be null or one integer"),
    ("prompt_ids", [[5, 10**9, 7]], "prompt token ids must be in 0-"),
    ("prompt_ids", [[]], "prompt_ids must be non-empty token id lists"),
    ("prompt_ids", "hello", "prompt_ids must be non-empty token id lists"),
    ("stop", ["x"] * 20000, "stop must be at most 4 strings of 1-256 characters"),
    ("greedy", "yes", "greedy must be true or false"),
])
def test_a_bad_field_of_the_internal_route_is_a_400(server, field: str, value: Any, message: str) -> None:  # noqa: F811
    url, token, _ = server
    status, reply = call(url, "/generate", {**GENERATE, field: value}, token)
    assert status == 400, reply
    assert reply["error"].startswith(message) and "\n" not in reply["error"], reply


def test_the_internal_route_reads_top_k_minus_one_as_off(server) -> None:  # noqa: F811
    url, token, _ = server
    off = call(url, "/generate", {**GENERATE, "top_k": -1}, token)
    zero = call(url, "/generate", {**GENERATE, "top_k": 0}, token)
    assert off[0] == 200 and off == zero


def test_a_request_past_the_time_budget_is_a_408_and_the_engine_serves_the_next(server) -> None:  # noqa: F811
    """A budget of 0 s: the first check, before the second decode step, stops the request (whatever the machine's
    speed); the engine is free at once and serves the next request within its budget."""
    url, token, engine = server
    engine.request_seconds = 0.0
    status, reply = call(url, "/generate", {**GENERATE, "max_new_tokens": 4}, token)
    assert status == 408 and reply["error"].startswith("the request sampled for longer than the server's "
                                                       "--request-seconds=0 (stopped at token 1)"), reply
    status, reply = call(url, COMPLETIONS, {"prompt": "Hello", "max_tokens": 3}, token)
    assert status == 408, reply
    engine.request_seconds = 600.0
    status, reply = call(url, "/generate", GENERATE, token)
    assert status == 200 and len(reply["samples"][0][0]) >= 1


def test_a_greedy_request_keeps_the_time_budget_too(server) -> None:  # noqa: F811
    """Greedy decoding (an OpenAI request at temperature 0) runs through the same budget check."""
    url, token, engine = server
    engine.request_seconds = 0.0
    try:
        status, reply = call(url, COMPLETIONS, {"prompt": "Hello", "max_tokens": 3, "temperature": 0}, token)
    finally:
        engine.request_seconds = 600.0
    assert status == 408, reply
