"""The asynchronous mode for real: ``rlhf-lab serve --engine hf`` takes each version of the weights between two decode
steps of the request in progress (rlhf_lab/generation/serve_engine.py, serving.py), says which version sampled each
token, and the trainer's client (``generation=vllm_server`` with ``generation.weight_updates``) publishes a version
after every update and reads the versions back.

Timing is made exact where a test compares numbers: a load is staged first and let land at a chosen decode step, so
the server's samples can be checked token for token against the simulator (rlhf_lab/generation/inflight.py) landing
the same version at the same step. The two-process run checks what holds at any timing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rlhf_lab.generation import serving
from rlhf_lab.generation.serve_engine import HFServerEngine
from tests.integration.test_serve_openai import serve_process, server  # noqa: F401  (server: the fixture)
from tests.integration.test_serve_security import call
from tests.limits import HANG_GUARD_S

REQUEST = {"prompt_ids": [[5, 9, 14], [7, 3]], "group_size": 2, "max_new_tokens": 8, "temperature": 1.0,
           "top_p": 1.0, "top_k": 0, "max_prompt_tokens": 16, "seeds": [11, 12], "greedy": False, "stop": [],
           "in_flight": True}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlhf_lab.config import compose
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny"])
    tokenizer = loading.load_tokenizer(cfg.model)
    folder = tmp_path_factory.mktemp("served") / "model"
    model = loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0)
    model.generation_config.eos_token_id = None  # every sample decodes all its steps
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def newer(engine: HFServerEngine, seed: int = 1) -> dict[str, torch.Tensor]:
    """Another version of the served model's weights (each moved by noise)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.5 * torch.randn(p.shape, generator=generator)
            for name, p in engine.model.named_parameters()}


def landing_at(engine: HFServerEngine, step: int) -> None:
    """The engine's staged loads land at decode step ``step`` of its next request, not before."""
    real, calls = engine.land, [0]

    def land() -> bool:
        calls[0] += 1  # the first call is before the request's first token, the s-th after step s
        return real() if calls[0] > step else False

    engine.land = land


def held_until_staged(engine: HFServerEngine, step: int) -> list[int]:
    """The engine's decode waits at step ``step`` until a load is staged, so it lands there whatever the timing;
    returns the count of landing calls so far (the first is before the request's first token)."""
    real, calls = engine.land, [0]

    def land() -> bool:
        calls[0] += 1
        if calls[0] == step + 1:
            deadline = time.monotonic() + HANG_GUARD_S
            while not engine.staged and time.monotonic() < deadline:
                time.sleep(0.01)
        return real()

    engine.land = land
    return calls


@pytest.mark.parametrize("partial", [False, True])
def test_a_load_landing_mid_request_samples_as_the_simulator_scripts_it(model_folder: Path, partial: bool) -> None:
    """A version staged while a request decodes lands at its step 3: the request goes on (every sample keeps all
    its tokens), the tokens from step 3 on come from the new weights, and the samples and log-probs equal, bit for
    bit, the simulator's landing the same version at the same step (the cache of the old weights kept in flight,
    recomputed under ``partial``); neither equals a request that no load reached."""
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.hf import HFGeneration
    from rlhf_lab.generation.inflight import InflightSchedule
    from rlhf_lab.generation.staleness import SnapshotRing

    untouched = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    plain = untouched.generate(dict(REQUEST))
    engine = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    weights = newer(engine)
    landed = engine.stage(weights, 5)
    landing_at(engine, 3)
    served = engine.generate({**REQUEST, "partial": partial})
    assert landed.is_set() and engine.version == 5
    assert engine.sample_versions == [[0, 0, 0, 5, 5, 5, 5, 5]] * 4
    assert all(len(tokens) == REQUEST["max_new_tokens"] for tokens, _ in served)

    policy = HFServerEngine(str(model_folder), "float32", max_model_len=64).model
    ring = SnapshotRing(policy, 1)
    ring.remember(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            parameter.copy_(weights[name])
    ring.remember(1)
    schedule = InflightSchedule(ring, 0, 1, 3, partial)
    simulated = HFGeneration(policy, engine.tokenizer, SamplingSettings(8, 1.0, 1.0, 0, 16), keep_logits=False)
    simulated.between_steps = schedule
    rollout = simulated.generate([[5, 9, 14], [7, 3]], 2, seeds=[11, 12], settings=SamplingSettings(8, 1.0, 1.0, 0, 16))
    assert rollout.response_ids.tolist() == [tokens for tokens, _ in served]
    assert torch.equal(rollout.logprobs, torch.tensor([logprobs for _, logprobs in served]))
    assert schedule.versions == [0, 0, 0, 1, 1, 1, 1, 1]
    assert [logprobs[:3] for _, logprobs in plain] == [logprobs[:3] for _, logprobs in served]
    assert [logprobs[3:] for _, logprobs in plain] != [logprobs[3:] for _, logprobs in served]


def test_a_load_sent_while_the_server_samples_lands_between_two_steps(server, tmp_path: Path) -> None:  # noqa: F811
    """Over HTTP: ``/load_weights`` with the trainer's version, sent while ``/generate`` decodes, does not wait for
    the request to end: it lands at the decode's next step (held here at step 2 until the load is staged), the
    reply says version 4, and the generate reply's ``versions`` say which version sampled each token."""
    from safetensors.torch import save_file

    url, token, engine = server  # (test_serve_openai's fixture, over this module's model)
    sync = tmp_path / "sync"
    assert call(url, "/health", token=token)[1]["in_flight"] is True
    (sync / "v4").mkdir()
    weights = newer(engine)
    save_file({name: t.contiguous() for name, t in weights.items()}, str(sync / "v4" / "model.safetensors"))
    calls = held_until_staged(engine, 2)
    replies = {}
    thread = threading.Thread(target=lambda: replies.setdefault("generate", call(url, "/generate", REQUEST, token)))
    thread.start()
    while calls[0] < 3:  # the request is decoding
        time.sleep(0.01)
    assert call(url, "/load_weights", {"folder": "v4", "version": 4}, token) == (200, {"loaded": len(weights),
                                                                                      "version": 4})
    thread.join(HANG_GUARD_S)
    status, reply = replies["generate"]
    assert status == 200 and reply["versions"] == [[0, 0, 4, 4, 4, 4, 4, 4]] * 4
    assert all(len(tokens) == 8 for tokens, _ in reply["samples"])
    status, reply = call(url, "/load_weights", {"folder": "v4", "version": -1}, token)
    assert status == 400 and reply["error"].startswith("version=-1 must be an integer >= 0")
    status, reply = call(url, "/generate", REQUEST, token)  # idle: the next request reports the version it holds
    assert reply["versions"][0][0] == 4


def test_a_load_with_no_request_in_progress_streams_in_at_once(model_folder: Path, tmp_path: Path) -> None:
    """With no request in progress the server streams a load in, one weight at a time (nothing staged, so no whole
    copy in host memory), after any load staged before it, and labels it with the trainer's version."""
    engine = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    weight_server = serving.WeightServer(engine, tmp_path, "token")
    first, second = newer(engine, 1), newer(engine, 2)
    earlier = engine.stage(first, 3)  # staged while a request ran, not landed yet
    engine.stage = lambda *args: pytest.fail("an idle load was staged")
    streamed: list[str] = []

    def named():
        for name, tensor in second.items():
            streamed.append(name)
            yield name, tensor

    assert weight_server._take(named(), 4) == len(second)
    assert earlier.is_set() and streamed == list(second)
    assert engine.version == weight_server.weights_version == 4
    assert all(torch.equal(p, second[name]) for name, p in engine.model.named_parameters())


def test_the_client_turns_the_servers_versions_into_each_tokens_version() -> None:
    """The server's versions per sample become [B, T] per token, 0 off the response; anything but one list of
    versions per sample is one line."""
    from rlhf_lab.generation.server import token_versions

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert token_versions([[2, 3, 3], [2, 2, 3, 3]], mask).tolist() == [[2, 3, 3, 0], [2, 2, 3, 3]]
    with pytest.raises(RuntimeError, match=r"versions \[\[1, 'x'\], \[1\]\] are not 2 lists of versions"):
        token_versions([[1, "x"], [1]], mask)
    with pytest.raises(RuntimeError, match=r"versions \[\[1\]\] are not 2 lists"):
        token_versions([[1]], mask)


def test_a_load_waits_for_a_request_that_did_not_ask_for_weights_in_flight(model_folder: Path) -> None:
    """A request without ``in_flight`` (a batch-mode sampler's, an OpenAI route's) is sampled by one version from
    start to end: a load staged while it decodes lands after it, at the next request."""
    engine = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    plain = engine.generate({**REQUEST, "in_flight": False})
    landed = engine.stage(newer(engine), 5)
    landing_at(engine, 3)
    served = engine.generate({**REQUEST, "in_flight": False})
    assert not landed.is_set() and engine.version == 0 and served == plain
    assert engine.sample_versions == [[0] * 8] * 4
    del engine.land  # the engine's own again: a request's start lands what is staged
    engine.generate({**REQUEST, "in_flight": False})
    assert landed.is_set() and engine.sample_versions == [[5] * 8] * 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("updates", "over_cap"), [("in_flight", "drop"), ("partial", "wait")])
def test_a_run_against_a_server_in_its_own_process_takes_weights_in_flight(model_folder: Path, tmp_path: Path,
                                                                          updates: str, over_cap: str) -> None:
    """Two processes: ``rlhf-lab serve --engine hf`` and a run with ``generation.weight_updates`` sampling 2 batches
    ahead, capped at 1 update. Whatever the timing: the staleness is logged every step, no token is newer than the
    policy that trains on it, none older than the launch of its batch, and what the cap dropped or waited for is a
    share of the batch; the run ends normally."""
    sync = tmp_path / "sync"
    process, port = answering_server(model_folder, sync)
    try:
        check_an_async_run(port, sync, tmp_path / "run", updates, over_cap)
    finally:
        process.terminate()
        process.wait(HANG_GUARD_S)


def check_an_async_run(port: int, sync: Path, run: Path, updates: str, over_cap: str, *overrides: str) -> None:
    """A 4-step run of the tiny model (``overrides`` after) against the server at ``port``, sampling 2 batches ahead
    and capped at 1 update: it ends normally, logs the staleness every step, and what the cap left is within it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rlhf_lab", "model=tiny", "trainer.precision=fp32", "trainer.steps=4",
               "trainer.prompts_per_step=2", "algorithm.group_size=2", "trainer.max_new_tokens=6",
               "trainer.eval_prompts=0", "trainer.progress_bar=false", "reward=length", "trainer.lr=1e-2",
               "trainer.save=none", "generation=vllm_server", f"generation.url=http://127.0.0.1:{port}",
               f"generation.sync_folder={sync}", "generation.max_staleness=2",
               f"generation.weight_updates={updates}", "algorithm.tis_cap=2.0", f"trainer.output_dir={run}",
               "trainer.num_threads=1", "generation.staleness_cap=1", f"generation.over_cap={over_cap}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "time/step_s" in row]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    share = f"rollout/stale_{'dropped' if over_cap == 'drop' else 'waited'}_frac"
    for row in rows[1:]:  # the batches sampled ahead: what the cap left in the loss is within it
        assert 0 <= row[share] <= 1
        if row.get("rollout/stale_dropped_frac", 0) < 1:
            assert 0 <= row["staleness/token_mean"] <= row["staleness/sample_max"] <= 1
            assert 0 <= row["staleness/multi_version_frac"] <= 1
    assert rows[0]["staleness/sample_max"] == 0  # the first batch is sampled in its own step


def answering_server(model_folder: Path, sync: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """``rlhf-lab serve --engine hf`` (``extra``: other arguments) in its own process, once it answers: (the process,
    its port)."""
    port = free_port()
    sync.mkdir()
    process = serve_process(model_folder, sync, port, 64, *extra)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (sync / serving.TOKEN_FILE).exists() or not _answers(port, sync):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-3000:]
        time.sleep(0.2)
    return process, port


def _answers(port: int, sync: Path) -> bool:
    try:
        token = (sync / serving.TOKEN_FILE).read_text().strip()
        return call(f"http://127.0.0.1:{port}", "/health", token=token)[0] == 200
    except OSError:
        return False


def test_a_server_that_takes_weights_between_requests_only_is_refused_in_one_line(compose, tmp_path: Path) -> None:
    """``generation.weight_updates=in_flight`` against a server whose engine cannot stage a load (a stand-in
    without ``stage``): the client stops at construction, naming the server and the two ways on."""
    from rlhf_lab.config import ConfigError
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.server import VLLMServerGeneration

    with stand_in_server(tmp_path) as (url, sync):
        with pytest.raises(ConfigError) as raised:
            VLLMServerGeneration(torch.nn.Linear(2, 2), None, SamplingSettings(max_new_tokens=2),
                                 options={"url": url, "sync_folder": str(sync), "weight_updates": "in_flight"})
        assert str(raised.value) == (f"generation.weight_updates=in_flight: rlhf-lab serve at {url} takes weights "
                                     "between requests only (its engine stages no load); start this rlhf-lab's serve "
                                     "(--engine hf or vllm), or set generation.weight_updates=batch")


@contextmanager
def stand_in_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``rlhf-lab serve`` over a stand-in engine (no ``stage``, no hf decode) in a thread: (its url, its sync
    folder) for the block."""
    from tests.integration.test_serve_security import StandInEngine

    sync = tmp_path / "sync"
    sync.mkdir()
    started, holder = threading.Event(), {}
    thread = threading.Thread(target=serving.serve, args=(str(tmp_path), "127.0.0.1", 0), daemon=True, kwargs=dict(
        sync_folder=sync, engine_factory=lambda *args: StandInEngine({}),
        on_ready=lambda http: (holder.setdefault("http", http), started.set())))
    thread.start()
    assert started.wait(HANG_GUARD_S)
    try:
        yield f"http://127.0.0.1:{holder['http'].server_address[1]}", sync
    finally:
        holder["http"].shutdown()


@pytest.mark.parametrize("ahead", [["generation.max_staleness=1"], ["generation.continuous=true"]])
def test_a_server_killed_mid_run_stops_the_trainer_in_one_line(model_folder: Path, tmp_path: Path,
                                                               ahead: list[str]) -> None:
    """SIGKILL to ``rlhf-lab serve`` while the trainer samples from it ahead (a batch in flight, or a stream of
    groups): the trainer stops with exit status 2 and one line naming the server (whether the kill caught a request
    mid-way or between two), no traceback; every metrics line it wrote before is whole."""
    import signal

    sync = tmp_path / "sync"
    process, port = answering_server(model_folder, sync)
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        run = tmp_path / "run"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        trainer = subprocess.Popen(
            [sys.executable, "-m", "rlhf_lab", "model=tiny", "trainer.precision=fp32", "trainer.steps=500",
             "trainer.prompts_per_step=2", "algorithm.group_size=2", "trainer.max_new_tokens=6",
             "trainer.eval_prompts=0", "trainer.progress_bar=false", "reward=length", "trainer.save=none",
             "generation=vllm_server", f"generation.url=http://127.0.0.1:{port}", f"generation.sync_folder={sync}",
             *ahead, "generation.weight_updates=in_flight", f"trainer.output_dir={run}",
             "trainer.num_threads=1", "logger=none"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        metrics = run / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[1][-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        _, stderr = trainer.communicate(timeout=HANG_GUARD_S)
        assert trainer.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr
        (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert line.startswith("error: generation.url: ") and f"http://127.0.0.1:{port}" in line, line
        assert all(json.loads(row)["step"] >= 0 for row in metrics.read_text().splitlines())
    finally:
        process.kill()
        process.wait(HANG_GUARD_S)


def test_weights_broadcast_over_the_group_land_in_flight_too(model_folder: Path) -> None:
    """``generation.weight_sync=collective``: the weights the trainer's rank 0 broadcasts while a request decodes are
    staged as they arrive and land between two decode steps (held at step 2 here until staged), with the trainer's
    version."""
    from rlhf_lab.generation.weight_group import WeightGroup
    from tests.unit.test_weight_group import free_port as group_port

    engine = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    weight_server = serving.WeightServer(engine, model_folder, "token")
    port, joined = group_port(), {}
    thread = threading.Thread(target=lambda: joined.setdefault("group", WeightGroup("127.0.0.1", port, 1, "gloo")))
    thread.start()
    sender = WeightGroup("127.0.0.1", port, 0, "gloo")
    thread.join(HANG_GUARD_S)
    weight_server.group = joined["group"]
    calls = held_until_staged(engine, 2)
    replies: dict[str, dict] = {}
    generating = threading.Thread(target=lambda: replies.setdefault("generate", weight_server.generate(dict(REQUEST))))
    generating.start()
    while calls[0] < 3:
        time.sleep(0.01)
    receiving = threading.Thread(target=lambda: replies.setdefault("load", weight_server.receive_weights({"version": 9})))
    receiving.start()
    weights = newer(engine)
    for name, tensor in weights.items():
        sender.send(name, tensor)
    sender.end()
    receiving.join(HANG_GUARD_S)
    generating.join(HANG_GUARD_S)
    assert replies["load"] == {"loaded": len(weights), "version": 9}
    assert replies["generate"]["versions"] == [[0, 0, 9, 9, 9, 9, 9, 9]] * 4
    assert all(torch.equal(p, weights[name]) for name, p in engine.model.named_parameters())
