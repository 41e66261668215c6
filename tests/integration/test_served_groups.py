"""The continuous engine for real: ``rlhf-lab serve --engine hf`` runs a stream of prompt groups on its own clock
(rlhf_lab/generation/serve_groups.py) and the trainer keeps ``generation.engine_groups`` of them launched, taking the
earliest completed (rlhf_lab/generation/served_groups.py, ``generation.continuous=true`` with
``generation=vllm_server``).

Where a test compares numbers the timing is made exact: a version is staged and let land at a chosen tick, and the
server's groups are checked token for token against the simulator (rlhf_lab/generation/continuous.py) landing the
same version at the same tick. The two-process run checks what holds at any timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_lab.generation import serve_groups, serving
from rlhf_lab.generation.serve_engine import HFServerEngine
from rlhf_lab.generation.serve_groups import GroupStream
from rlhf_lab.generation.serve_token import RequestError
from tests.integration.test_async_server import answering_server, model_folder, newer, stand_in_server  # noqa: F401  (fixture)
from tests.integration.test_serve_openai import server  # noqa: F401  (fixture)
from tests.limits import HANG_GUARD_S

SETTINGS = {"group_size": 2, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "max_prompt_tokens": 16, "stop": []}
PROMPTS = [[5, 9, 14], [7, 3], [8, 8], [100, 2]]


def stream_over(engine: HFServerEngine, tmp_path: Path, **settings) -> GroupStream:
    """A group stream opened on a server over ``engine`` (its routes called directly, no HTTP)."""
    stream = GroupStream(serving.WeightServer(engine, tmp_path, "token"), engine)
    stream.open({**SETTINGS, **settings})
    return stream


def taken(stream: GroupStream, **ask) -> dict:
    """The stream's take for ``ask``, asked again (as the trainer's client does) until it is complete."""
    for _ in range(int(HANG_GUARD_S // 10)):
        reply = stream.take({**ask, "wait_s": 10})
        if reply["complete"]:
            return reply
    raise AssertionError(f"the stream did not complete {ask} in {HANG_GUARD_S} s")


def landing_at_tick(engine: HFServerEngine, tick: int) -> None:
    """The engine's staged loads land before tick ``tick`` of the stream (counted from its first), not before."""
    real, calls = engine.land, [0]

    def land() -> bool:
        calls[0] += 1  # the stream's thread lands before each tick
        return real() if calls[0] > tick else False

    engine.land = land


@pytest.mark.parametrize("partial", [False, True])
def test_a_served_group_samples_as_the_simulator_does_where_a_version_lands_at_the_same_tick(
        model_folder: Path, tmp_path: Path, partial: bool) -> None:  # noqa: F811
    """Version 5 staged and landing before tick 3: the server's four groups (launched at tick 0, decoding 8 ticks)
    carry versions 0, 0, 0, 5, ..., and their tokens and log-probs equal, bit for bit, the simulator's engine whose
    policy takes the same weights before its tick 3 (the older weights' cache kept in flight, recomputed under
    ``partial``); a stream no load reached samples the same first three tokens and other later ones."""
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.continuous import ContinuousEngine
    from rlhf_lab.generation.hf import HFGeneration

    engine = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    weights = newer(engine)
    stream = stream_over(engine, tmp_path, partial=partial)
    landed = engine.stage(weights, 5)
    landing_at_tick(engine, 3)
    stream.submit({"keys": [0, 1, 2, 3], "prompt_ids": PROMPTS, "seeds": [1, 2, 3, 4]})
    served = taken(stream, count=4)
    assert served["complete"] and landed.is_set() and engine.version == 5
    assert [group["key"] for group in served["groups"]] == [0, 1, 2, 3]
    assert all(versions == [0, 0, 0, 5, 5, 5, 5, 5] for group in served["groups"] for versions in group["versions"])
    assert [(group["launched"], group["completed"]) for group in served["groups"]] == [(0, 8)] * 4

    policy = HFServerEngine(str(model_folder), "float32", max_model_len=64).model
    version = [0]
    simulator = ContinuousEngine(HFGeneration(policy, engine.tokenizer, SamplingSettings(8, 1.0, 1.0, 0, 16),
                                              keep_logits=False), 2, 4, 0, partial, lambda: version[0])
    simulator.source = lambda n: (PROMPTS[n], f"prompt {n}", n + 1)
    simulator.fill()
    simulator.run(3)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            parameter.copy_(weights[name])
    version[0] = 5
    simulator.run(5)
    assert [g.index for g in simulator.buffer] == [0, 1, 2, 3] and not simulator.running
    expected = simulator.samples(simulator.buffer)
    tokens = [sample[0] for group in served["groups"] for sample in group["samples"]]
    logprobs = [sample[1] for group in served["groups"] for sample in group["samples"]]
    assert expected.input_ids[:, expected.prompt_width:].tolist() == tokens
    assert torch.equal(expected.logprobs, torch.tensor(logprobs))

    untouched = stream_over(HFServerEngine(str(model_folder), "float32", max_model_len=64), tmp_path)
    untouched.submit({"keys": [0, 1, 2, 3], "prompt_ids": PROMPTS, "seeds": [1, 2, 3, 4]})
    plain = [sample[1] for group in taken(untouched, count=4)["groups"]
             for sample in group["samples"]]
    assert [row[:3] for row in plain] == [row[:3] for row in logprobs]
    assert [row[3:] for row in plain] != [row[3:] for row in logprobs]


def test_the_groups_that_complete_first_are_taken_first(model_folder: Path, tmp_path: Path) -> None:  # noqa: F811
    """With a stop string the groups end at different ticks: one take of 4 gives them in the order they completed
    (group 2, launched beside group 1, ends a tick earlier and overtakes it), each completed at the tick its
    longest sample ended; the four launched together all started at tick 0."""
    stream = stream_over(HFServerEngine(str(model_folder), "float32", max_model_len=64), tmp_path, stop=["e"])
    stream.submit({"keys": [0, 1, 2, 3], "prompt_ids": PROMPTS, "seeds": [1, 2, 3, 4]})
    served = taken(stream, count=4)["groups"]
    assert [group["key"] for group in served] == [0, 2, 1, 3]
    assert [group["completed"] for group in served] == [max(len(tokens) for tokens, _ in group["samples"])
                                                        for group in served] == [2, 2, 3, 7]
    assert {group["launched"] for group in served} == {0}


def test_the_trainers_client_keeps_its_groups_launched_and_takes_the_earliest(server, tmp_path: Path) -> None:  # noqa: F811
    """The trainer's client over HTTP, 4 groups launched, 2 taken a step: each take gives groups in the order they
    completed with their samples and versions, launches two more at once, and keeps 4 launched and not taken;
    the prompt stream goes on in order (every prompt launched once). A checkpoint's state takes the groups in
    progress (the server finishes them) and a client built from it trains on them first, the same samples, then
    launches from where the stream was."""
    url, _, engine = server
    client = served_client(url, tmp_path)
    first = client.take(2)
    assert [g.completed for g in first] == sorted(g.completed for g in first)
    assert len(client.out) == 4 and client.launches == 6
    batch = client.samples(first)
    assert batch.input_ids.shape[0] == 4 and batch.versions is not None
    assert int(batch.versions.max()) == 0  # no weights sent: version 0 throughout
    second = client.take(2)
    assert sorted(g.index for g in [*first, *second, *client.out]) == list(range(8))

    tensors, plain = client.state()
    assert client.out == [] and len(client.held) == 4
    resumed = served_client(url, tmp_path)
    resumed.load_state(tensors, json.loads(json.dumps(plain)))
    again = resumed.take(2)
    assert [g.index for g in again] == [g.index for g in client.held[:2]]
    assert torch.equal(resumed.samples(again).input_ids, client.samples(client.held[:2]).input_ids)
    assert resumed.launches == 10 and sorted(g.index for g in resumed.out) == [8, 9]


def served_client(url: str, tmp_path: Path):
    """The trainer's client of the server at ``url`` (the ``server`` fixture's, its sync folder in ``tmp_path``), 4
    groups of 2, the prompts of ``PROMPTS`` in turn, the n-th with seed n."""
    from rlhf_lab.config import compose
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.served_groups import ServedGroups
    from rlhf_lab.generation.server import VLLMServerGeneration
    from rlhf_lab.models import loading

    tokenizer = loading.load_tokenizer(compose(["model=tiny"]).model)
    engine = VLLMServerGeneration(torch.nn.Linear(2, 2), tokenizer, SamplingSettings(6, 1.0, 1.0, 0, 16, ("e",)),
                                  options={"url": url, "sync_folder": str(tmp_path / "sync"),  # the server's token
                                           "weight_updates": "in_flight"})
    client = ServedGroups(engine, 2, 4)
    client.source = lambda n: (PROMPTS[n % 4], f"prompt {n}", n)
    return client


def test_the_stream_refuses_bad_requests_in_one_line(model_folder: Path, tmp_path: Path,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A take before any stream is open, a key already in the stream, more groups asked for than it holds, a count
    or wait out of range, a prompt too long or outside the vocabulary, more groups than a stream holds: each a 400
    naming the value; the stream goes on."""
    engine = HFServerEngine(str(model_folder), "float32", max_model_len=64)
    stream = GroupStream(serving.WeightServer(engine, tmp_path, "token"), engine)
    with pytest.raises(RequestError, match=r"no group stream is open; POST /groups/open first"):
        stream.take({"count": 1})
    stream.open(SETTINGS)
    stream.submit({"keys": [7], "prompt_ids": [[5, 9]], "seeds": [1]})
    with pytest.raises(RequestError, match=r"group key 7 is already in the stream"):
        stream.submit({"keys": [7], "prompt_ids": [[5, 9]], "seeds": [1]})
    with pytest.raises(RequestError, match=r"count=2: only 1 groups are in the stream; submit more first"):
        stream.take({"count": 2, "wait_s": 0})
    with pytest.raises(RequestError, match=r"count=0 must be an integer >= 1"):
        stream.take({"count": 0})
    with pytest.raises(RequestError, match=r"wait_s=-1 must be a number of seconds"):
        stream.take({"count": 1, "wait_s": -1})
    with pytest.raises(RequestError, match=r"a prompt of 17 tokens is longer than the stream's max_prompt_tokens"):
        stream.submit({"keys": [8], "prompt_ids": [[5] * 17], "seeds": [1]})
    with pytest.raises(RequestError, match=rf"prompt token ids must be in 0-{engine.vocabulary - 1}"):
        stream.submit({"keys": [8], "prompt_ids": [[engine.vocabulary]], "seeds": [1]})
    monkeypatch.setattr(serve_groups, "MAX_GROUPS", 2)
    with pytest.raises(RequestError, match=r"3 groups would be in the stream; it holds at most 2"):
        stream.submit({"keys": [8, 9], "prompt_ids": [[5], [6]], "seeds": [1, 2]})
    assert [g["key"] for g in taken(stream, count=1)["groups"]] == [7]


def test_a_server_without_a_stream_of_groups_is_refused_in_one_line(compose, tmp_path: Path) -> None:
    """``generation.continuous=true`` against a server whose engine runs no stream (vLLM's, here a stand-in): the
    client stops at construction, naming the server and the two ways on."""
    from rlhf_lab.config import ConfigError
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.served_groups import ServedGroups
    from rlhf_lab.generation.server import VLLMServerGeneration

    with stand_in_server(tmp_path) as (url, sync):
        engine = VLLMServerGeneration(torch.nn.Linear(2, 2), None, SamplingSettings(max_new_tokens=2),
                                      options={"url": url, "sync_folder": str(sync), "weight_updates": "batch"})
        with pytest.raises(ConfigError) as raised:
            ServedGroups(engine, 2, 4)
        assert str(raised.value) == (f"generation.continuous=true: rlhf-lab serve at {url} runs no stream of groups "
                                     "(its engine is vLLM's); start it with --engine hf, or set "
                                     "generation.continuous=false (generation.max_staleness batches in flight)")


def run_against(port: int, sync: Path, run: Path, *overrides: str) -> list[dict]:
    """A run of the tiny model against the server at ``port`` with ``generation.continuous=true`` (4 groups of 2
    launched, 2 taken a step; ``overrides`` after): it ends normally; its metrics lines of the training steps."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rlhf_lab", "model=tiny", "trainer.precision=fp32", "trainer.prompts_per_step=2",
               "algorithm.group_size=2", "trainer.max_new_tokens=6", "trainer.eval_prompts=0", "reward=length",
               "trainer.progress_bar=false", "trainer.lr=1e-2", "generation=vllm_server", "logger=none",
               f"generation.url=http://127.0.0.1:{port}", f"generation.sync_folder={sync}", "trainer.num_threads=1",
               "generation.continuous=true", "generation.engine_groups=4", "algorithm.tis_cap=2.0",
               f"trainer.output_dir={run}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "time/step_s" in row]


@pytest.mark.parametrize(("updates", "over_cap"), [("in_flight", "drop"), ("partial", "wait")])
def test_a_run_against_a_servers_stream_of_groups(model_folder: Path, tmp_path: Path, updates: str,  # noqa: F811
                                                  over_cap: str) -> None:
    """Two processes: ``rlhf-lab serve --engine hf`` and a run keeping 4 groups launched there, capped at 1 update.
    Whatever the timing: step 0 trains on groups of the first weights (staleness 0); step 1's groups were all
    launched before the first update landed, so their oldest tokens are exactly 1 update behind; what the cap left
    is within it; the server's clock only moves on; the run ends normally. Stopped after 2 steps (its checkpoint
    holds the 4 groups launched and not taken, completed) and resumed to 4, it trains on and logs steps 2 and 3."""
    sync = tmp_path / "sync"
    process, port = answering_server(model_folder, sync)
    run = tmp_path / "run"
    common = [f"generation.weight_updates={updates}", "generation.staleness_cap=1", f"generation.over_cap={over_cap}",
              "trainer.save=all"]
    try:
        run_against(port, sync, run, "trainer.steps=2", *common)
        (held,) = run.glob("**/async_engine.safetensors")
        state = json.loads((held.parent / "trainer_state.json").read_text())["continuous"]
        assert state["served"] and state["launches"] == 8  # 4, then 2 more after each of 2 steps
        assert sorted(group["index"] for group in state["groups"]) == [4, 5, 6, 7]
        rows = run_against(port, sync, run, "trainer.steps=4", "trainer.resume=auto", *common)  # every line
    finally:
        process.terminate()
        process.wait(HANG_GUARD_S)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert rows[0]["staleness/sample_max"] == 0 and rows[1]["staleness/sample_max"] == 1
    clocks = [row["async/clock_ticks"] for row in rows]
    assert clocks[0] > 0 and clocks == sorted(clocks)
    for row in rows:
        assert 0 <= row["rollout/stale_dropped_frac"] <= 1 and 0 <= row["rollout/stale_waited_frac"] <= 1
        if row["rollout/stale_dropped_frac"] < 1:
            assert 0 <= row["staleness/token_mean"] <= row["staleness/sample_max"] <= 1
    if over_cap == "wait":
        assert all(row["rollout/stale_dropped_frac"] == 0 for row in rows)
