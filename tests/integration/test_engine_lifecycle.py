"""Training runs on the stand-in vLLM that keeps vLLM's sleep contract (tests/fake_vllm.py), with the engine
sleeping as on a GPU: every step samples the policy's current weights (the canary's difference stays at float
noise and the engine's weight version follows the updates) for full weights and LoRA, staleness 0 and 1, an
evaluation in between and a resume; an ignored load stops the run with one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_lab.training.loop import Trainer
from tests import fake_vllm

ENGINE = ["generation=vllm", "generation.sleep=true", "trainer.lr=1e-2", "trainer.eval_every=1", "reward=length", "reward.min_words=1", "reward.max_words=2",
          "reward.slope_words=1", "trainer.max_new_tokens=6"]


@pytest.fixture(autouse=True)
def stand_in_vllm(monkeypatch):
    """``import vllm`` gives the stand-in; each test configures its own faults."""
    yield from fake_vllm.installed(monkeypatch)


def steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "reward/mean" in line]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("staleness", [0, 1])
def test_every_step_samples_the_synced_weights(compose, tiny_overrides, tmp_path, lora: bool, staleness: int) -> None:
    lora_overrides = ["model.lora.enabled=true", "model.lora.r=4"] if lora else []
    cfg = compose([*tiny_overrides(tmp_path), *ENGINE, *lora_overrides, "trainer.steps=3",
                   f"generation.max_staleness={staleness}"])
    Trainer(cfg, tmp_path / "run").train()
    lines = steps(tmp_path / "run")
    assert len(lines) == 3
    # Step t samples with the weights of t updates (staleness 1: of t − 1, the first two steps both the initial).
    expected = [max(step - staleness, 0) for step in range(3)]
    held = [line.get("rollout/weight_version") for line in lines]
    assert held == expected, held
    for line in lines[1:]:  # a load before every step after the first: each checked
        assert line["rollout/weight_sync_diff"] < 1e-4, line
    llm = fake_vllm.LLM.built[0]
    assert len(fake_vllm.LLM.built) == 1  # the evaluation samples with the run's engine
    assert llm.calls[-1] == f"sleep({1 if lora else 2})"


@pytest.mark.parametrize(("lora", "sleep"), [(False, True), (True, True), (False, False)])
def test_a_resumed_run_gives_the_engine_the_checkpoint_s_weights(compose, tiny_overrides, tmp_path, lora: bool,
                                                                  sleep: bool) -> None:
    """The engine of a resumed run is built from the initial weights, before the checkpoint's load: it takes the
    checkpoint's weights (2 updates) before its first batch, whether or not a level-2 sleep would reload them anyway."""
    engine = [*[o for o in ENGINE if not o.startswith("generation.sleep")], f"generation.sleep={str(sleep).lower()}"]
    lora_overrides = ["model.lora.enabled=true", "model.lora.r=4"] if lora else []
    first = compose([*tiny_overrides(tmp_path), *engine, *lora_overrides, "trainer.steps=2"])
    Trainer(first, tmp_path / "run").train()
    resumed = compose([*tiny_overrides(tmp_path), *engine, *lora_overrides, "trainer.steps=3", "trainer.resume=auto"])
    fake_vllm.LLM.built = []
    Trainer(resumed, tmp_path / "run").train()
    last = steps(tmp_path / "run")[-1]
    assert last["step"] == 2 and last["rollout/weight_version"] == 2, last
    assert last["rollout/weight_sync_diff"] < 1e-4, last


def test_a_win_rate_on_a_lora_policy_samples_the_reference_without_the_adapter(compose, tiny_overrides,
                                                                               tmp_path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), *ENGINE, "model.lora.enabled=true", "model.lora.r=4",
                   "trainer.steps=1", "eval.win_rate=true"])
    Trainer(cfg, tmp_path / "run").train()
    assert len(fake_vllm.LLM.built) == 1  # no second engine for the reference
    llm = fake_vllm.LLM.built[0]
    # Each evaluation (before and after the update) samples the policy with its adapter, then the reference
    # through the same engine with none; training's batch samples with the adapter.
    assert None in llm.requested and llm.requested.count(None) == 2, llm.requested
    assert llm.requested[-1] is None and llm.requested[-2] is not None, llm.requested
    final = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert 0.0 <= final["eval/win_rate"] <= 1.0


@pytest.mark.parametrize("extra", [[], ["eval.temperature=0.5"], ["model.lora.enabled=true", "model.lora.r=4"]])
def test_the_eval_command_samples_the_policy_and_the_reference_with_one_engine(compose, tiny_overrides, tmp_path,
                                                                             extra: list[str]) -> None:
    """``rlhf-lab eval`` with a win rate: its own sampling settings and the reference share the policy's engine
    (the reference through the hf engine under full weights, the same engine with the adapter off under LoRA)."""
    from rlhf_lab.tools.evaluate import _evaluate

    cfg = compose([*tiny_overrides(tmp_path), "generation=vllm", "reward=length", "eval.win_rate=true", *extra])
    result = _evaluate(cfg, [], [], "tiny", None, None, tmp_path / "out")
    assert 0.0 <= result["metrics"]["eval/win_rate"] <= 1.0
    assert len(fake_vllm.LLM.built) == 1
    adapters = fake_vllm.LLM.built[0].requested
    if extra and extra[0].startswith("model.lora"):
        assert adapters[0] is not None and adapters[-1] is None, adapters  # the policy, then the reference
    else:
        assert len(adapters) == 1, adapters  # the reference samples through the hf engine over its own weights


def test_an_ignored_load_stops_the_run_at_its_step(run_cli, tiny_overrides, tmp_path) -> None:
    fake_vllm.LLM.faults = {"ignore_loads": {2}}
    overrides = [o for o in [*tiny_overrides(tmp_path), *ENGINE] if not o.startswith(("trainer.eval", "generation.sleep", "trainer.max_new", "trainer.steps"))]
    code, _, err = run_cli([*overrides, "trainer.eval_prompts=0", "generation.sleep=false", "trainer.steps=4",
                             "trainer.max_new_tokens=6"])
    assert code == 2, err
    line = [text for text in err.splitlines() if text.startswith("error:")]
    assert len(line) == 1 and "weight sync before step 2" in line[0] and "sync_check_tol=0.02" in line[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize(("override", "expected"), [
    ("generation.sync_check_tol=-0.5", "error: generation.sync_check_tol=-0.5 is out of range; must be >= 0.0"),
    ("generation.sync_check_tol=abc", "error: generation.sync_check_tol"),
    ("generation.gpu_memory_utilization=1.5", "error: generation.gpu_memory_utilization=1.5 is out of range; must be "
                                              "a share of the GPU's memory in (0, 1], e.g. 0.35"),
    ("generation.gpu_memory_utilization=0", "error: generation.gpu_memory_utilization=0.0 is out of range"),
    ("generation.tensor_parallel_size=2", "error: generation.tensor_parallel_size=2 does not divide the 1 ranks"),
])
def test_engine_settings_that_cannot_run_are_one_line(run_cli, tiny_overrides, tmp_path, override: str,
                                                      expected: str) -> None:
    code, _, err = run_cli([*tiny_overrides(tmp_path), "generation=vllm", override])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(expected), err
