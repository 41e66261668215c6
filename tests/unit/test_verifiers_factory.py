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


@pytest.mark.parametrize(("findable", "env_id", "message"), [
    (set(), "math-env", "env=verifiers needs the verifiers package (0.3.1), which cannot be imported here (No module "
                        "named 'verifiers.legacy'); install it with `make install-verifiers`"),
    ({"verifiers.legacy"}, None, "env=verifiers needs env.id=NAME"),
    ({"verifiers.legacy"}, "org/math-env", "env.id='org/math-env' is not an installed verifiers environment (No "
                                           "module named 'math_env'); install it into the verifiers venv"),
    ({"verifiers.legacy"}, "nowhere:make_env", "env.id='nowhere:make_env' cannot be imported (No module named "
                                               "'nowhere')"),
])
def test_an_environment_that_cannot_be_found_is_refused_at_compose_time(compose, monkeypatch, findable: set,
                                                                        env_id: str | None, message: str) -> None:
    """Composing ``env=verifiers`` looks for the package and env.id's module (imports neither): what is missing is
    one line there, before any model loads; what is there composes."""
    monkeypatch.setattr(verifiers_env, "_findable", lambda module: module in findable)
    overrides = ["model=tiny", "env=verifiers", *([f"env.id={env_id}"] if env_id else [])]
    with pytest.raises(EnvError) as raised:
        compose(overrides)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    monkeypatch.setattr(verifiers_env, "_findable", lambda module: module in {"verifiers.legacy", "math_env"})
    assert compose(["model=tiny", "env=verifiers", "env.id=org/math-env"]).env.id == "org/math-env"
    monkeypatch.setitem(verifiers_env.environments, "in_process", Environment())  # as provide() leaves it
    assert compose(["model=tiny", "env=verifiers", "env.id=in_process"]).env.id == "in_process"
