"""What the Python API takes beside overrides, as TRL's trainers take it: reward functions and ``datasets`` datasets.

``rlhf_lab.train(overrides, reward_funcs=fn, train_dataset=ds)`` becomes overrides the run folder records:

- a reward function becomes ``reward=python reward.function=module:function``. A function that cannot be imported
  by name (defined in ``__main__``, a notebook, a lambda, a closure) is kept in :data:`functions` for this process,
  and its spec names it there (``rlhf_lab.app.api_inputs:functions.NAME``): the run trains, and a later
  ``rlhf-lab eval`` or resume in another process says in one line that it cannot import it. Several functions are a
  ``composite`` of weight 1 each, each logged as ``reward/<function name>`` (TRL sums them too);
- a ``datasets.Dataset`` (and an ``eval_dataset``) is saved into the run folder (``RUN/data``, ``save_to_disk``)
  and read back as ``data=local data.path=RUN/data``, so the run, its resume and ``rlhf-lab eval`` read the same
  rows. Its columns are the data's columns: ``prompt`` (text or messages) or ``messages``, and any others the
  rewards read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlhf_lab.errors import ConfigError

functions = SimpleNamespace()  # reward functions of this process that cannot be imported by name
DATA_FOLDER = "data"


def function_spec(function: Callable[..., Any]) -> str:
    """``module:qualname`` of an importable function, else its name in :data:`functions` (set here)."""
    from rlhf_lab.rewards.python_function import load_function

    if not callable(function):
        raise ConfigError(f"reward_funcs: {function!r} is not callable; give functions fn(prompts, responses, "
                          "**columns) -> floats")
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        spec = f"{module}:{qualname}"
        try:
            if load_function(spec) is function:
                return spec
        except ValueError:
            pass
    name = re.sub(r"\W", "_", getattr(function, "__name__", "reward"))
    for number in range(len(vars(functions)) + 1):
        candidate = name if number == 0 else f"{name}_{number}"
        if getattr(functions, candidate, function) is function:
            setattr(functions, candidate, function)
            return f"{__name__}:functions.{candidate}"
    raise AssertionError("unreachable: a free name is always found")


def reward_overrides(reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]]) -> list[str]:
    """The overrides of one reward function (``reward=python``) or several (a ``composite``, weight 1 each)."""
    listed = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
    if not listed:
        raise ConfigError("reward_funcs is empty; give a function or a list of functions")
    specs = [function_spec(function) for function in listed]
    if len(specs) == 1:
        return ["reward=python", f"reward.function={specs[0]}"]
    keys: list[str] = []
    for function in listed:
        key = re.sub(r"\W", "_", getattr(function, "__name__", "reward"))
        keys.append(key if key not in keys else f"{key}_{len(keys)}")
    components = ",".join(f"{{name:python,key:{key},weight:1.0,function:'{spec}'}}" for key, spec in zip(keys, specs))
    return ["reward=composite", f"reward.components=[{components}]"]


def data_overrides(folder: Path, train_dataset: Any, eval_dataset: Any = None) -> list[str]:
    """Save the datasets into ``folder/data`` (a dataset dict: ``train``, ``eval``) and return the overrides that read
    them (``data=local``)."""
    import datasets

    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is not None and not isinstance(dataset, datasets.Dataset):
            raise ConfigError(f"{name} is a {type(dataset).__name__}; give a datasets.Dataset (one split)")
    splits = {"train": train_dataset, **({"eval": eval_dataset} if eval_dataset is not None else {})}
    target = Path(folder) / DATA_FOLDER
    datasets.DatasetDict(splits).save_to_disk(str(target))
    return ["data=local", f"data.path={target.resolve()}", "data.train_split=train", "data.eval_split=eval"]
