"""``env=verifiers`` environment factories that raise or exit (rlhf_lab/envs/verifiers_env.py): one line naming
``env.id``, on a stand-in for ``verifiers.legacy`` (its ``Environment`` class and ``load_environment``), so the
main venv tests it; the verifiers venv runs the real package (tests/integration/test_env_verifiers.py)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest

from rlhf_lab.envs import verifiers_env
from rlhf_lab.errors import EnvError


class Environment:
    pass


def raising(**kwargs):
    raise RuntimeError("dataset download failed\nsecond line")


def exiting(**kwargs):
    sys.exit(0)


def good(**kwargs):
    return Environment()


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    def load_environment(env_id, **kwargs):
        if env_id == "missing":
            raise ValueError(f"Could not import '{env_id}' environment")
        if env_id == "broken":
            raise KeyError("split")
        return exiting() if env_id == "quitter" else Environment()

    module = ModuleType("factories")
    module.raising, module.exiting, module.good = raising, exiting, good
    monkeypatch.setitem(sys.modules, "factories", module)
    monkeypatch.setattr(verifiers_env, "import_verifiers",
                        lambda: SimpleNamespace(Environment=Environment, load_environment=load_environment))


@pytest.mark.parametrize(("env_id", "message"), [
    ("factories:raising", "env.id='factories:raising': its environment factory raised RuntimeError: dataset "
                          "download failed"),
    ("factories:exiting", "env.id='factories:exiting': its environment factory exited (sys.exit(0)) instead of "
                          "returning an environment; nothing was trained"),
    ("broken", "env.id='broken': its environment factory raised KeyError: 'split'"),
    ("quitter", "env.id='quitter': its environment factory exited (sys.exit(0))"),
    ("missing", "env.id='missing' is not an installed verifiers environment (Could not import 'missing' "
                "environment)"),
])
def test_a_factory_that_raises_or_exits_is_one_line(env_id: str, message: str) -> None:
    with pytest.raises(EnvError) as raised:
        verifiers_env.load_environment(env_id, {})
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_good_factory_gives_its_environment() -> None:
    assert isinstance(verifiers_env.load_environment("factories:good", {}), Environment)
