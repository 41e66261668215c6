"""The policy served in-process for ``env=verifiers``: ``rlhf-lab serve``'s OpenAI routes over the trainer's own engine.

A ``verifiers`` environment calls its model through an OpenAI client. :class:`PolicyServer` answers that client on
a free loopback port, with a secret made for the run (sent as the client's API key) and the serve command's trust
rules (:mod:`rlhf_lab.generation.serving`: the Bearer token, JSON bodies of a bounded size; only the two OpenAI
routes, no route that loads weights or reads a path). Each request is sampled by the engine the trainer hands to
the batch (:meth:`PolicyServer.serving`): the :class:`~rlhf_lab.generation.worker.RolloutWorker`, awake, which has
loaded the policy's current weights where its engine holds weights of its own (``generation=vllm``,
``vllm_server``) or samples with the policy itself (``generation=hf``). So the server always serves the weights of
the step, through the one weight-sync path the run already has.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_lab.generation.openai_routes import OpenAIRoutes
from rlhf_lab.generation.serve_engine import sample_request
from rlhf_lab.generation.serve_token import RequestError
from rlhf_lab.generation.serving import WeightServer, make_http_server

SERVED_NAME = "policy"  # the model name the environment's client asks for


class _BatchEngine:
    """The server's engine: the batch's generation engine while a batch runs, none otherwise."""

    def __init__(self) -> None:
        self.backend: Any = None

    def generate(self, request: dict[str, Any]) -> list[list[list[Any]]]:
        if self.backend is None:  # a request outside a batch (a stray client): no weights to answer with
            raise RequestError(503, "the policy is not serving now (between training batches)")
        return sample_request(self.backend, request)


class PolicyServer:
    """The OpenAI routes on ``http://127.0.0.1:PORT/v1`` for the run's tokenizer (see the module's text)."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.token = secrets.token_urlsafe(32)
        self.engine = _BatchEngine()
        self._folder = tempfile.TemporaryDirectory(prefix="rlhf_lab_verifiers_")  # no path route reads it
        server = WeightServer(self.engine, Path(self._folder.name), self.token)  # type: ignore[arg-type]
        server.model = SERVED_NAME
        server.routes = dict(OpenAIRoutes(server, SERVED_NAME, max_model_len, tokenizer).routes)
        self.http = make_http_server(server, "127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, name="rlhf-lab verifiers server", daemon=True).start()
        self._finalizer = weakref.finalize(self, _close, self.http, self._folder)

    @contextmanager
    def serving(self, backend: Any) -> Iterator[PolicyServer]:
        """Requests in the block are sampled by ``backend`` (the awake rollout worker)."""
        self.engine.backend = backend
        try:
            yield self
        finally:
            self.engine.backend = None

    def close(self) -> None:
        self._finalizer()


def _close(http: Any, folder: tempfile.TemporaryDirectory) -> None:
    http.shutdown()
    http.server_close()
    folder.cleanup()
