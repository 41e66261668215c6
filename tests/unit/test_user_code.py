"""User code that misbehaves is one line, never a traceback, never a silent success: a reward module or plug-in
with a syntax error, one that raises or calls ``sys.exit`` (at import or while scoring), a reward returning a
mapping, and scores no run can learn from (beyond ±1e15, or none finite under ``on_nonfinite=drop``)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import rlhf_lab.components  # noqa: F401  (the built-in rewards)
from rlhf_lab.errors import ConfigError, RewardError
from rlhf_lab.registry import get
from rlhf_lab.step.experience import screen_scores


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


@pytest.mark.parametrize(("source", "problem"), [
    ("def score(prompts, responses)\n    return [1.0]\n", "SyntaxError: expected ':'"),
    ("raise RuntimeError('no config file')\n", "RuntimeError: no config file"),
    ("import sys\nsys.exit(0)\n", "SystemExit: 0"),
], ids=["syntax_error", "raises", "exits"])
def test_a_reward_module_that_fails_to_import_is_one_line(user_modules, source: str, problem: str) -> None:
    name = user_modules("broken_reward_module", source)
    with pytest.raises(ValueError) as raised:
        get("reward", "python")({"name": "python", "function": f"{name}:score"})
    message = str(raised.value)
    assert message.startswith(f"reward function spec '{name}:score': cannot import module '{name}' ({problem}")
    assert "\n" not in message


def test_a_plugin_that_exits_while_importing_is_one_line(user_modules) -> None:
    from rlhf_lab.app.plugins import load_plugins

    name = user_modules("exiting_plugin", "import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=rf"^plugins: '{name}' failed to import \(SystemExit: 0\)"):
        load_plugins([name])


def test_a_reward_that_exits_or_returns_a_mapping_is_a_reward_error(monkeypatch) -> None:
    module = types.ModuleType("misbehaving_rewards")
    module.exits = lambda prompts, responses: sys.exit(0)
    module.by_index = lambda prompts, responses: {i: 1.0 for i in range(len(responses))}
    monkeypatch.setitem(sys.modules, "misbehaving_rewards", module)
    build = lambda name: get("reward", "python")({"name": "python", "function": f"misbehaving_rewards:{name}"})  # noqa: E731
    with pytest.raises(RewardError, match=r"^reward 'python' \(misbehaving_rewards:exits\) called sys.exit\(0\); "
                                          r"a reward returns scores or raises$"):
        build("exits")(["p", "q"], ["a", "b"])
    with pytest.raises(RewardError, match=r"returned a dict; expected 2 numbers, one per response in order"):
        build("by_index")(["p", "q"], ["a", "b"])


def test_scores_no_run_can_learn_from_are_refused() -> None:
    huge = torch.tensor([1.0, 3e38, -2.0, 0.5])
    with pytest.raises(RewardError, match=r"^reward 'x' returned 3e\+38 for sample 1 \(p0\); scores beyond ±1e\+15 "
                                          r"overflow the advantage statistics: rescale the reward$"):
        screen_scores(huge, {}, ["p0", "p1"], 2, "drop", "reward 'x'")
    nothing = torch.full((4,), float("nan"))
    with pytest.raises(RewardError, match=r"^reward 'x' returned no finite score for any of the 4 samples \(p0, \.\.\.\): "
                                          r"reward.on_nonfinite=drop would train on nothing$"):
        screen_scores(nothing, {}, ["p0", "p1"], 2, "drop", "reward 'x'")
    scores, valid = screen_scores(torch.tensor([1.0, float("nan"), 1e15, 2.0]), {}, ["p0", "p1"], 2, "drop", "x")
    assert valid.tolist() == [True, False, True, True] and scores[1] == 1.0  # the group's finite mean
