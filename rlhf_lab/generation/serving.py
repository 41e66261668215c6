"""The ``rlhf-lab serve`` server: who it lets in, what it loads, and the engine behind it.

Trust rules (the serve guide explains them for users):

- **A shared secret on every route.** The token comes from ``--token-file``, else ``RLHF_LAB_SERVE_TOKEN``, else
  one generated at start and written (mode 0600) to ``SYNC_FOLDER/.serve_token``; the trainer reads it from the
  same place (:func:`client_token`) and sends it as ``Authorization: Bearer TOKEN``. It is compared in constant
  time. Without it a request is answered 401 and nothing else is read.
- **JSON only, and small.** A POST must say ``Content-Type: application/json`` (a web page's simple cross-site
  POST cannot) and give a ``Content-Length`` between 0 and :data:`MAX_BODY`; the body is read with a timeout.
- **Paths stay in the sync folder.** A folder named in ``/load_weights`` or ``/load_adapter`` is taken relative to
  the server's ``--sync-folder`` and must resolve inside it; its files must be regular files, not symbolic links,
  and only safetensors are read (pickle files are never loaded).
- **The group only toward the trainer.** ``/open_group`` dials only ``--trainer-host``.
- **A load either happens or says it did not.** Weights from a folder are checked (names and shapes against the
  model's own checkpoint) before the engine takes any; a folder with nothing loadable is refused; an adapter that
  cannot sample is dropped again. Either way the previous weights keep serving and the reply says so.
- **Loopback by default.** Bound to any other address, the server prints a warning line: plain HTTP carries the
  token in clear.

The engine is any object with :class:`ServerEngine`'s methods (vLLM's, the hf one, or a test's stand-in).
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rlhf_lab.errors import ToolError
from rlhf_lab.generation.openai_routes import OpenAIRoutes, check_generate
from rlhf_lab.generation.serve_engine import (
    DEFAULT_MEMORY_SHARE,
    ServerEngine,
    VLLMServerEngine,
    check_dtype,
    check_start,
    checkpoint_shapes,
    weight_names,
)
from rlhf_lab.generation.serve_groups import add_group_routes
from rlhf_lab.generation.serve_token import (
    TOKEN_ENV,
    TOKEN_FILE,
    RequestError,
    folder_inside,
    is_loopback,
    need,
    regular_files,
    server_token,
)
from rlhf_lab.generation.vllm import lora_rank_slot
from rlhf_lab.generation.weight_group import WeightGroup

MAX_BODY = 64 << 20  # bytes of one request (a generate request of 1,000 prompts of 4,096 tokens is ~30 MB)
READ_TIMEOUT = 60.0  # seconds a request may take to arrive


class WeightServer:
    """The server's decisions, apart from HTTP: which requests it takes and what each does to the engine."""

    model = ""  # the served model, as ``rlhf-lab serve`` was given it (GET /health says it)

    def __init__(self, engine: ServerEngine, sync_folder: Path, token: str, trainer_host: str = "127.0.0.1",
                 shapes: dict[str, tuple[int, ...]] | None = None, lora_rank: int = 0) -> None:
        self.engine, self.token, self.trainer_host = engine, token, trainer_host
        self.sync_folder = Path(sync_folder).resolve() if sync_folder is not None else None
        self.shapes, self.lora_rank = shapes or {}, lora_rank
        self.lock = threading.Lock()
        self.weights_version, self.adapter_version, self.adapter_folder = 0, 0, None
        self.group: WeightGroup | None = None
        self.routes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "/generate": self.generate, "/load_weights": self.load_weights, "/load_adapter": self.load_adapter,
            "/open_group": self.open_group, "/receive_weights": self.receive_weights}
        self.get_routes: dict[str, Callable[[], dict[str, Any]]] = {"/health": self.health}

    def health(self) -> dict[str, Any]:
        """``GET /health``: the model served, whether a load lands between two decode steps (in flight), and whether
        it runs a stream of groups (:mod:`.serve_groups`)."""
        return {"ok": True, "model": self.model, "in_flight": hasattr(self.engine, "stage"),
                "groups": "/groups/take" in self.routes}

    def allowed(self, authorization: str | None) -> bool:
        if not self.token:  # never: an empty secret would let in an empty header
            return False
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 7235); a bare token is not one
            return False
        return hmac.compare_digest(given.strip().encode(), self.token.encode())

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        need(request, "prompt_ids", "group_size", "max_new_tokens", "temperature", "top_p", "top_k",
              "max_prompt_tokens")
        request = check_generate(request, getattr(self.engine, "vocabulary", None))
        with self.lock:
            samples = self.engine.generate(request)
            # Per sample, the version of the weights that sampled each token: the engine's where loads land in
            # flight, else the version held for the whole request.
            versions = (getattr(self.engine, "sample_versions", None)
                        or [[self.weights_version] * len(ids) for ids, _ in samples])
        return {"samples": samples, "versions": versions}

    def load_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        from safetensors import SafetensorError, safe_open

        folder = folder_inside(self.sync_folder, request.get("folder"), "folder")
        shards = regular_files(folder, "*.safetensors")
        if not shards:
            raise RequestError(400, f"{folder} holds no *.safetensors (pickle files are never loaded); nothing "
                                    f"loaded, the previous weights (version {self.weights_version}) still serve")
        names: list[tuple[Path, str]] = []
        unchanged = f"nothing loaded, the previous weights (version {self.weights_version}) still serve"
        try:
            for shard in shards:  # every header checked before the engine takes any weight
                with safe_open(str(shard), "pt") as handle:
                    for name in weight_names(handle):
                        self._check_shape(name, tuple(handle.get_slice(name).get_shape()), unchanged)
                        names.append((shard, name))
        except (SafetensorError, OSError) as error:
            raise RequestError(400, f"{shard.name} in {folder} is not readable safetensors ({error}); nothing "
                                    f"loaded, the previous weights (version {self.weights_version}) still "
                                    "serve") from None
        if not names:
            raise RequestError(400, f"{folder} holds no weights; nothing loaded, the previous weights (version "
                                    f"{self.weights_version}) still serve")

        def streamed() -> Iterator[tuple[str, torch.Tensor]]:
            for shard in shards:  # one tensor at a time, read from the memory-mapped file
                with safe_open(str(shard), "pt") as handle:
                    for name in weight_names(handle):
                        yield name, handle.get_tensor(name)

        loaded = self._take(streamed(), self._label(request))
        return {"loaded": loaded, "version": self.weights_version}

    def _label(self, request: dict[str, Any]) -> int:
        """The version a load's weights are known by: the trainer's (its updates), else one more than now."""
        version = request.get("version", self.weights_version + 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError(400, f"version={version!r} must be an integer >= 0 (the trainer's updates behind the "
                                    f"weights); nothing loaded, the previous weights (version {self.weights_version}) "
                                    "still serve")
        return version

    def _take(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """``weights`` in as ``version``: streamed once no request is in progress, or :meth:`_staged` mid-request."""
        stage = getattr(self.engine, "stage", None)
        if stage is None:
            self.lock.acquire()  # between two requests
        elif not self.lock.acquire(blocking=False):  # a request in progress
            return self._staged(weights, version, stage)
        try:
            if stage is not None:
                self.engine.land()  # the loads staged before this one go first
            loaded = self._fitted(weights, self.engine.load_weights)
            self.weights_version = version if loaded else self.weights_version
            if loaded and stage is not None:
                self.engine.version = version
        finally:
            self.lock.release()
        return loaded

    def _staged(self, weights: Iterator[tuple[str, torch.Tensor]], version: int, stage: Callable[..., Any]) -> int:
        """The whole state in host memory, landed mid-request where it asked (``in_flight``), else here after it."""
        landed: list[threading.Event] = []

        def staged(named: Iterator[tuple[str, torch.Tensor]]) -> int:
            state = dict(named)
            if state:
                landed.append(stage(state, version))
            return len(state)

        loaded = self._fitted(weights, staged)
        while loaded and not landed[0].wait(0.05):
            if self.lock.acquire(blocking=False):  # no request in progress: land them here
                try:
                    self.engine.land()
                finally:
                    self.lock.release()
        self.weights_version = version if loaded else self.weights_version
        return loaded

    def _fitted(self, weights: Iterator[tuple[str, torch.Tensor]],
                take: Callable[[Iterator[tuple[str, torch.Tensor]]], int]) -> int:
        """``take(weights)``; weights the model cannot take (vLLM's bare ``assert`` on a shape, a name it lacks) are a
        one-line refusal naming the weight, not an empty error."""
        last: list[str] = []

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                last[:] = [name]
                yield name, tensor

        try:
            return take(named())
        except (AssertionError, KeyError, ValueError, RuntimeError) as error:
            at = f" at weight {last[0]!r}" if last else ""
            raise RequestError(400, f"the weights sent do not fit the served model {self.model or '(unnamed)'}{at} "
                                    f"({type(error).__name__}{': ' + str(error) if str(error) else ''}); the load "
                                    "stopped there") from None

    def _check_shape(self, name: str, shape: tuple[int, ...], after: str) -> None:
        if not self.shapes:
            return
        known = self.shapes.get(name)
        if known is None and not name.endswith("lm_head.weight"):  # a tied head is written under its own name
            raise RequestError(400, f"weight {name!r} is not one of the model's; {after}")
        if known is not None and known != shape:
            raise RequestError(400, f"weight {name!r} has shape {list(shape)}, the model's is {list(known)}; {after}")

    def load_adapter(self, request: dict[str, Any]) -> dict[str, Any]:
        folder = folder_inside(self.sync_folder, request.get("folder"), "folder")
        config_files = regular_files(folder, "adapter_config.json")
        weights = regular_files(folder, "adapter_model.safetensors")
        if not config_files or not weights:
            raise RequestError(400, f"{folder} holds no adapter_config.json and adapter_model.safetensors (pickle "
                                    f"files are never loaded); the previous adapter (version "
                                    f"{self.adapter_version}) still serves")
        try:
            rank = json.loads(config_files[0].read_text(encoding="utf-8")).get("r")
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise RequestError(400, f"{config_files[0]} is not a JSON adapter config; the previous adapter (version "
                                    f"{self.adapter_version}) still serves") from None
        if self.lora_rank and (not isinstance(rank, int) or rank > lora_rank_slot(self.lora_rank)):
            raise RequestError(400, f"the adapter's rank r={rank!r} is more than the server's --lora-rank "
                                    f"{self.lora_rank}; the previous adapter (version {self.adapter_version}) still "
                                    "serves")
        with self.lock:
            version = self.adapter_version + 1
            self.engine.set_adapter(str(folder), version)
            try:  # one token from one prompt: an adapter the engine cannot use is dropped here, not at /generate
                self.engine.generate({"prompt_ids": [[0]], "group_size": 1, "max_new_tokens": 1, "temperature": 1.0,
                                      "top_p": 1.0, "top_k": 0, "max_prompt_tokens": 1, "greedy": True})
            except Exception as error:
                self.engine.set_adapter(self.adapter_folder, self.adapter_version)
                raise RequestError(400, f"the adapter in {folder} cannot sample ({type(error).__name__}: {error}); "
                                        f"the previous adapter (version {self.adapter_version}) still "
                                        "serves") from None
            self.adapter_version, self.adapter_folder = version, str(folder)
        return {"adapter": version}

    def open_group(self, request: dict[str, Any]) -> dict[str, Any]:
        need(request, "host", "port", "backend")
        host, port = request["host"], request["port"]
        try:
            allowed = socket.gethostbyname(str(host)) == socket.gethostbyname(self.trainer_host)
        except OSError:
            allowed = False
        if not allowed:
            raise RequestError(403, f"host {host!r} is not the trainer's: this server opens a group only toward "
                                    f"--trainer-host {self.trainer_host}")
        if not isinstance(port, int) or not 0 < port < 65536 or request["backend"] not in ("nccl", "gloo"):
            raise RequestError(400, "port must be 1-65535 and backend nccl or gloo")
        self.group = WeightGroup(str(host), port, 1, request["backend"])
        return {"group": request["backend"]}

    def receive_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.group is None:
            raise RequestError(409, "no weight group: the trainer opens one first (POST /open_group)")
        stream = self.group.stream()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:  # the group carries one weight at a time: checked as it arrives
                self._check_shape(name, tuple(tensor.shape), "the load stopped there (the weights before it were "
                                                             "taken); sync again with the server's model")
                yield name, tensor

        version = self._label(request)
        try:
            loaded = self._take(checked(), version)
        except Exception:
            for _ in stream:  # read to its end, so the trainer's broadcast finishes
                pass
            raise
        if loaded == 0:
            raise RequestError(400, "the trainer sent no weights; the previous weights still serve")
        return {"loaded": loaded, "version": self.weights_version}


# ------------------------------------------------------------------------------------------ HTTP
def make_http_server(server: WeightServer, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server answering for ``server`` on ``host:port`` (port 0: any free one)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT  # a request that does not arrive in time frees its thread

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if server.allowed(self.headers.get("Authorization")):
                return True
            self._reply(401, {"error": "no or wrong token: send Authorization: Bearer TOKEN (the server's token "
                                       "file, see rlhf-lab serve --help)"})
            return False

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            if self._authorised():
                route = server.get_routes.get(self.path)
                self._reply(200, route()) if route is not None else self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorised():
                return
            try:
                request = self._body()
                route = server.routes.get(self.path)
                if route is None:
                    raise RequestError(404, f"no route {self.path}")
                self._reply(200, route(request))
            except RequestError as error:
                self._reply(error.status, {"error": str(error)})
            except Exception as error:  # the trainer gets the server's one line
                self._reply(500, {"error": f"{type(error).__name__}: {error}"})

        def _body(self) -> dict[str, Any]:
            media = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if media != "application/json":
                raise RequestError(415, f"Content-Type {media or 'none'!r}: this server takes application/json only")
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                raise RequestError(411, f"Content-Length {length!r}: give the body's length in bytes")
            if int(length) > MAX_BODY:
                raise RequestError(413, f"a body of {int(length)} bytes is more than this server takes ({MAX_BODY})")
            try:
                request = json.loads(self.rfile.read(int(length)) or b"{}")
            except (ValueError, UnicodeDecodeError):
                raise RequestError(400, "the body is not JSON") from None
            if not isinstance(request, dict):
                raise RequestError(400, "the body is not a JSON object")
            return request

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # connections waiting to be accepted: an agent's client opens many at once

    return Server((host, port), Handler)


def serve(model: str, host: str = "127.0.0.1", port: int = 8765, dtype: str = "auto", enforce_eager: bool = True,
          max_model_len: int = 2048, lora_rank: int = 0, *,
          sync_folder: str | Path | None, token_file: str | None = None, trainer_host: str = "127.0.0.1",
          memory_share: float = DEFAULT_MEMORY_SHARE,
          engine_factory: Callable[..., ServerEngine] = VLLMServerEngine,
          on_ready: Callable[[ThreadingHTTPServer], None] | None = None) -> None:
    """Run the server until interrupted or shut down (``rlhf-lab serve``). ``engine_factory`` builds its engine
    (vLLM's; tests give a stand-in); ``on_ready`` gets the HTTP server once it listens."""
    if not 0 < memory_share <= 1:
        raise ToolError(f"--gpu-memory-utilization {memory_share}: a share of the GPU in (0, 1]; the default "
                        f"{DEFAULT_MEMORY_SHARE} fits a 7B policy beside its trainer on 80 GB")
    folder = Path(sync_folder).expanduser() if sync_folder is not None else None
    if folder is not None and not folder.is_dir():
        raise ToolError(f"--sync-folder {str(folder)!r} is not a folder; create it (the trainer's "
                        "generation.sync_folder)")
    dtype = check_dtype(dtype, torch.cuda.is_available())
    token = server_token(folder, token_file)
    check_start(model, host, port)  # before the model's minutes of loading
    engine = engine_factory(model, dtype, enforce_eager, max_model_len, lora_rank, memory_share)
    weights = WeightServer(engine, folder, token, trainer_host, checkpoint_shapes(model), lora_rank)
    weights.model = model
    openai = OpenAIRoutes(weights, model, max_model_len, getattr(engine, "tokenizer", None))
    weights.routes.update(openai.routes)
    add_group_routes(weights, engine)  # --engine hf: the continuous engine's stream of groups
    weights.get_routes.update(openai.get_routes)
    http = make_http_server(weights, host, port)
    if not is_loopback(host):
        print(f"warning: rlhf-lab serve is bound to {host}, beyond this machine: whoever reaches it with the token "
              "can load weights into it, and plain HTTP carries the token in clear (bind 127.0.0.1 behind an SSH "
              "tunnel or a TLS proxy)", file=sys.stderr, flush=True)
    where = ("--token-file" if token_file else TOKEN_ENV if os.environ.get(TOKEN_ENV, "").strip()
             else str(folder / TOKEN_FILE))
    print(f"rlhf-lab serve: {model} ({dtype}) on http://{host}:{http.server_address[1]}, token in {where}",
          flush=True)
    if on_ready is not None:
        on_ready(http)
    if threading.current_thread() is threading.main_thread():  # Ctrl-C stops it, whatever handler the engine set
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        http.serve_forever()
    finally:
        http.server_close()
