"""The command line rejects bad configs at start: one line on stderr naming the value and what is allowed,
exit status 2, no traceback, and no model loaded or run folder written.

Every case runs ``python -m rlhf_lab`` in a subprocess with its own empty working folder. The cases are
started together (a few at a time) by a module fixture, since each one mostly waits for imports; each
parametrized test then checks one case's result.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlhf_lab.config.schema import ModelConfig, PPOConfig, SentimentRewardConfig, TrainerConfig
from tests.limits import HANG_GUARD_S

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def options(group: str, required: set[str]) -> str:
    """The options of a config group as the CLI lists them, after checking the contract's names are there."""
    found = sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))
    assert required <= set(found), f"conf/{group} lacks {required - set(found)}"
    return ", ".join(found)


def keys(schema: type) -> str:
    names = [field.name for field in dataclasses.fields(schema)]
    return ", ".join(names)


CASES: dict[str, tuple[list[str], str]] = {
    "unknown algorithm": (
        ["algorithm=foo"],
        f"algorithm='foo' is not an option; choose from: {options('algorithm', {'grpo', 'reinforce', 'rloo'})}",
    ),
    "unknown algorithm in a sweep": (
        ["-m", "algorithm=grpo,foo"],
        f"algorithm='foo' is not an option; choose from: {options('algorithm', {'grpo', 'reinforce', 'rloo'})}",
    ),
    "unknown kl": (
        ["kl=k4"],
        f"kl='k4' is not an option; choose from: {options('kl', {'kl', 'abs', 'mse', 'k3', 'full', 'none'})}",
    ),
    "unknown reward": (
        ["reward=happiness"],
        "reward='happiness' is not an option; choose from: "
        + options("reward", {"sentiment", "classifier", "reward_model", "python", "composite"}),
    ),
    "unknown model": (
        ["model=gpt5"],
        f"model='gpt5' is not an option; choose from: {options('model', {'smollm2_135m', 'tiny'})}",
    ),
    "unknown model key": (
        ["model.size=big"],
        f"unknown key 'model.size' for model=smollm2_135m; valid keys: {keys(ModelConfig)}",
    ),
    "key of another algorithm": (
        ["algorithm=ppo", "algorithm.weight_by=reward"],
        f"unknown key 'algorithm.weight_by' for algorithm=ppo; valid keys: {keys(PPOConfig)}",
    ),
    "appended key of another reward": (
        ["reward=sentiment", "+reward.min_words=3"],
        f"unknown key 'reward.min_words' for reward=sentiment; valid keys: {keys(SentimentRewardConfig)}",
    ),
    "unknown kl.placement": (
        ["kl.placement=advantage"],
        "kl.placement='advantage' is not valid; choose from: loss, reward",
    ),
    "unknown kl.controller": (
        ["kl.controller=pid"],
        "kl.controller='pid' is not valid; choose from: adaptive, fixed",
    ),
    "negative kl.coef": (["kl.coef=-0.1"], "kl.coef=-0.1 is out of range; must be >= 0.0"),
    "negative trainer.lr": (["trainer.lr=-1e-5"], "trainer.lr=-1e-05 is out of range; must be > 0.0"),
    "clip_eps above 1": (
        ["algorithm.clip_eps=1.5"],
        "algorithm.clip_eps=1.5 is out of range; must be in (0, 1) or null",
    ),
    "grpo with one sample per prompt": (
        ["algorithm=grpo", "algorithm.group_size=1"],
        "algorithm.group_size=1 is too small for algorithm=grpo; must be >= 2",
    ),
    "mini-batch not dividing the step": (
        ["trainer.prompts_per_step=3", "algorithm.group_size=2", "algorithm.mini_batch_size=4"],
        "algorithm.mini_batch_size=4 does not divide the 6 samples per step "
        "(trainer.prompts_per_step=3 x algorithm.group_size=2)",
    ),
    "zero new tokens": (["trainer.max_new_tokens=0"], "trainer.max_new_tokens=0 is out of range; must be >= 1"),
    "typo in a key": (["trainer.stepz=3"], f"unknown key 'trainer.stepz'; did you mean 'trainer.steps'? valid keys of trainer: {keys(TrainerConfig)}"),
    "typo in an appended key": (
        ["+trainer.stepz=3"],
        f"unknown key 'trainer.stepz'; did you mean 'trainer.steps'? valid keys of trainer: {keys(TrainerConfig)}",
    ),
    "appended key in a nested section": (
        ["+model.lora.rank=4"],
        "unknown key 'model.lora.rank'; valid keys of model.lora: enabled, r, alpha, dropout, target_modules",
    ),
    "wrong type": (["trainer.steps=abc"], "trainer.steps='abc' has the wrong type; expected int"),
    "adaptive controller without target": (
        ["kl.controller=adaptive"],
        "kl.target=None must be > 0 with kl.controller=adaptive",
    ),
    "python reward without a function": (["reward=python"], "reward.function=None must be 'module:function'"),
}


def test_listed_keys_include_the_contract_names() -> None:
    for name in ("steps", "lr", "prompts_per_step", "max_new_tokens", "eval_every", "resume", "device", "dtype"):
        assert f" {name}," in f" {keys(TrainerConfig)},"
    assert "lora" in keys(ModelConfig) and "name_or_path" in keys(ModelConfig)


@dataclasses.dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    cwd: Path
    cache: Path


def _run(args: list[str], cwd: Path, cache: Path) -> Outcome:
    """Run the CLI with an empty model cache of its own: loading the tokenizer or the model would write into it."""
    env = {**os.environ, "RLHF_LAB_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=HANG_GUARD_S)
    return Outcome(result.returncode, result.stdout, result.stderr, cwd, cache)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Outcome]:
    folders = {case: (tmp_path_factory.mktemp("cli"), tmp_path_factory.mktemp("cache")) for case in CASES}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case: pool.submit(_run, CASES[case][0], *folders[case]) for case in CASES}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_fails_at_start_with_one_line(results, case: str) -> None:
    outcome = results[case]
    expected = CASES[case][1]
    assert outcome.returncode == 2, outcome.stderr[-2000:]
    assert "Traceback" not in outcome.stderr
    assert outcome.stderr == f"error: {expected}\n"
    assert outcome.stdout == ""
    # "At start": before any tokenizer or model is loaded (the process's own cache folder stays empty) and before
    # anything is written; no time is asserted (a loaded machine is slower, not wrong).
    assert list(outcome.cache.iterdir()) == []  # no tokenizer or model was loaded
    assert list(outcome.cwd.iterdir()) == []  # no outputs/ run folder, no metrics, nothing at all
