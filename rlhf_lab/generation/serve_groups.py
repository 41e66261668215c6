"""The continuous engine for real: a stream of prompt groups on ``rlhf-lab serve --engine hf``, decoding on its own
clock while the trainer trains (``generation.continuous=true`` with ``generation=vllm_server``).

The server runs the continuous simulator's engine (:class:`~rlhf_lab.generation.continuous.ContinuousEngine`), the
same code, with the wall clock for its script: a thread of its own ticks (one decode step of every group in
progress) as long as a group is in progress, and between two ticks lands the weights the trainer sent meanwhile
(under the server's lock, the one a ``/generate`` request and a load between requests also take, so they come in
between two ticks). A group whose samples have all ended goes to the buffer of completed groups; the trainer takes
the earliest completed. Where the simulator reads the prompt stream itself, here the trainer's client sends each
group (:mod:`rlhf_lab.generation.served_groups` keeps ``generation.engine_groups`` of them launched and not taken):

- ``POST /groups/open``: the sampling settings, group size and ``partial`` of the stream, and the tick its clock
  starts from (a resumed run's goes on); any groups of an earlier stream are dropped;
- ``POST /groups/submit``: groups to launch, each its key, prompt token ids and seed; they start at the next tick;
- ``POST /groups/take``: the ``count`` groups completed first (or the groups of the given ``keys``), waiting up to
  ``wait_s`` seconds for them: each group's samples, its tokens' versions, and the ticks it was launched and
  completed at; ``complete`` false where they were not all in by then (nothing is taken: the client asks again).

Given the same weights at each tick a group samples exactly what the simulator's does: the same decode, the same
seeded stream, the same landing (tests/integration/test_served_groups.py stages a version at a chosen tick).

Over vLLM's engine (``--engine vllm``) there is no stream: its ``step()`` advances every request the engine holds,
so the groups' requests and a ``/generate`` request beside them (the weight-sync canary, an evaluation) would need
one dispatcher of the step's outputs, which is not built; GET /health says ``groups: false`` and the trainer stops
at the start in one line.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.continuous import ContinuousEngine, Group
from rlhf_lab.generation.openai_routes import check_generate
from rlhf_lab.generation.serve_token import RequestError, need

MAX_GROUPS = 4096  # groups one stream holds launched and not taken (a client keeps generation.engine_groups)
MAX_WAIT_S = 60.0  # the longest one take request waits before it answers ``complete: false``


class _ServedStream(ContinuousEngine):
    """The simulator's engine over the server's decode, its groups sent by the client (:meth:`fill` launches those
    submitted, in order, at the next tick) and its versions the labels of the weights the server holds."""

    def __init__(self, engine: Any, settings: SamplingSettings, group_size: int, partial: bool, version: Any) -> None:
        super().__init__(engine, group_size, 0, 0, partial, version)
        self.settings = settings
        self.pending: list[tuple[int, list[int], int]] = []  # (key, prompt ids, seed), oldest first
        self.seen = version()  # the weights held now are no landing for the first tick

    def fill(self) -> None:
        while self.pending:
            key, prompt_ids, seed = self.pending.pop(0)
            self.running.append(self.launch(key, prompt_ids, "", seed))

    def held(self) -> int:
        return len(self.pending) + len(self.running) + len(self.buffer)


class GroupStream:
    """The server's stream of groups (see the module's text): the routes, and the thread that ticks."""

    def __init__(self, server: Any, engine: Any) -> None:
        self.server, self.engine = server, engine  # the WeightServer and its HFServerEngine
        self.changed = threading.Condition(server.lock)  # a tick, a take's wait, a request: one at a time
        self.stream: _ServedStream | None = None
        self.failed: str | None = None  # the error that stopped the ticking thread
        self.thread: threading.Thread | None = None
        self.routes = {"/groups/open": self.open, "/groups/submit": self.submit, "/groups/take": self.take}

    def open(self, request: dict[str, Any]) -> dict[str, Any]:
        """A new stream with the request's sampling settings; the groups of an earlier one are dropped."""
        need(request, "group_size", "max_new_tokens", "temperature", "top_p", "top_k", "max_prompt_tokens")
        checked = check_generate({**request, "prompt_ids": [[0]], "seeds": None}, None)
        partial, clock = request.get("partial", False), request.get("clock", 0)
        if not isinstance(partial, bool):
            raise RequestError(400, f"partial={partial!r} must be true or false")
        if not isinstance(clock, int) or isinstance(clock, bool) or clock < 0:
            raise RequestError(400, f"clock={clock!r} must be an integer >= 0 (the ticks the stream starts from)")
        settings = SamplingSettings(checked["max_new_tokens"], checked["temperature"], checked["top_p"],
                                    checked["top_k"], checked["max_prompt_tokens"], tuple(checked["stop"]))
        with self.changed:
            self.engine.land()  # weights sent before the stream opened sample its first tick
            self.stream = _ServedStream(self.engine.engine, settings, checked["group_size"], partial,
                                        lambda: self.engine.version)
            self.stream.clock = clock
            self.failed = None
            if self.thread is None:
                self.thread = threading.Thread(target=self._ticking, name="rlhf-lab-groups", daemon=True)
                self.thread.start()
        return {"ok": True, "version": self.engine.version}

    def submit(self, request: dict[str, Any]) -> dict[str, Any]:
        """Groups launched at the next tick: ``keys``, ``prompt_ids`` (one list each) and ``seeds``."""
        stream = self._open()
        keys, prompts, seeds = request.get("keys"), request.get("prompt_ids"), request.get("seeds")
        if not (isinstance(keys, list) and keys and all(isinstance(k, int) and not isinstance(k, bool) for k in keys)):
            raise RequestError(400, "keys must be a non-empty list of integers, one per group")
        if not isinstance(seeds, list) or not isinstance(prompts, list) or not len(keys) == len(prompts) == len(seeds):
            raise RequestError(400, "prompt_ids and seeds must be lists with one entry per key")
        settings = stream.settings
        check_generate({"prompt_ids": prompts, "seeds": seeds, "group_size": stream.group_size, "top_k": 0,
                        "max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                        "max_prompt_tokens": settings.max_prompt_tokens}, getattr(self.engine, "vocabulary", None))
        long = [len(ids) for ids in prompts if len(ids) > settings.max_prompt_tokens]
        if long:
            raise RequestError(400, f"a prompt of {long[0]} tokens is longer than the stream's max_prompt_tokens "
                                    f"({settings.max_prompt_tokens})")
        with self.changed:
            held = {g.index for g in [*stream.running, *stream.buffer]} | {k for k, _, _ in stream.pending}
            again = sorted(held & set(keys)) or sorted(k for k in set(keys) if keys.count(k) > 1)
            if again:
                raise RequestError(400, f"group key {again[0]} is already in the stream; give each group a key of "
                                        "its own")
            if stream.held() + len(keys) > MAX_GROUPS:
                raise RequestError(400, f"{stream.held() + len(keys)} groups would be in the stream; it holds at "
                                        f"most {MAX_GROUPS}: take completed ones first")
            stream.pending.extend(zip(keys, [list(ids) for ids in prompts], seeds, strict=True))
            self.changed.notify_all()
            return {"held": stream.held()}

    def take(self, request: dict[str, Any]) -> dict[str, Any]:
        """The ``count`` groups completed first, or those of ``keys``, once they are in (see the module's text)."""
        stream = self._open()
        count, keys, wait = request.get("count"), request.get("keys"), request.get("wait_s", MAX_WAIT_S)
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, int) for k in keys)):
            raise RequestError(400, "keys must be a list of group keys")
        if keys is None and not (isinstance(count, int) and not isinstance(count, bool) and count >= 1):
            raise RequestError(400, f"count={count!r} must be an integer >= 1 (the groups to take)")
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT_S:
            raise RequestError(400, f"wait_s={wait!r} must be a number of seconds in [0, {MAX_WAIT_S:g}]")
        deadline = time.monotonic() + float(wait)
        with self.changed:
            arrived, buffered = stream.clock, len(stream.buffer)
            while True:
                if self.failed is not None:
                    raise RequestError(500, f"the server's group stream stopped: {self.failed}")
                if self.stream is not stream:
                    raise RequestError(409, "the stream was opened again meanwhile; its groups are gone")
                ready = ([g for g in stream.buffer if g.index in keys] if keys is not None else stream.buffer[:count])
                if len(ready) == (len(set(keys)) if keys is not None else count):
                    break
                if keys is None and stream.held() < count:
                    raise RequestError(400, f"count={count}: only {stream.held()} groups are in the stream; "
                                            "submit more first")
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"groups": [], "complete": False, "clock": stream.clock}
                self.changed.wait(left)
            stream.buffer = [g for g in stream.buffer if all(g is not r for r in ready)]
            replies = [self._reply(stream, group) for group in ready]
            return {"groups": replies, "complete": True, "clock": stream.clock, "buffered": buffered,
                    "waited_ticks": stream.clock - arrived}

    def _open(self) -> _ServedStream:
        if self.stream is None:
            raise RequestError(400, "no group stream is open; POST /groups/open first")
        return self.stream

    @staticmethod
    def _reply(stream: _ServedStream, group: Group) -> dict[str, Any]:
        rollout = stream.samples([group])
        lengths = rollout.response_mask.sum(-1).long().tolist()
        responses = rollout.input_ids[:, rollout.prompt_width:].tolist()
        return {"key": group.index, "launched": group.launched, "completed": group.completed,
                "samples": [[ids[:n], logprobs[:n]] for ids, logprobs, n in
                            zip(responses, rollout.logprobs.tolist(), lengths, strict=True)],
                "versions": [row[:n] for row, n in zip(rollout.versions.tolist(), lengths, strict=True)]}

    def _ticking(self) -> None:
        """The engine's clock: a tick whenever a group is in progress or submitted, the weights sent meanwhile landed
        before it; the lock is let go between two ticks (a request, a load, a take come in there)."""
        while True:
            with self.changed:
                while self.stream is None or self.failed is not None or not (self.stream.running or
                                                                              self.stream.pending):
                    self.changed.wait()
                try:
                    self.engine.land()
                    self.stream.fill()  # the groups submitted since the last tick start at this one
                    self.stream.tick()
                except Exception as error:  # noqa: BLE001  (every take is told, in one line)
                    self.failed = f"{type(error).__name__}: {error}"
                self.changed.notify_all()
            time.sleep(0)  # a request waiting for the lock gets it between two ticks


def add_group_routes(server: Any, engine: Any) -> None:
    """The group stream's routes on ``server`` where its engine decodes with the hf engine (``--engine hf``); GET
    /health then says ``groups``."""
    from rlhf_lab.generation.hf import HFGeneration

    if isinstance(getattr(engine, "engine", None), HFGeneration):
        server.routes.update(GroupStream(server, engine).routes)
