"""`python`: any user function ``fn(prompts, responses, **kwargs) -> N floats`` named in the config."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from rlhf_lab.registry import register
from rlhf_lab.rewards.base import ConfigLike, Reward, RewardOutput, as_scores, first_line


def load_function(spec: Any) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (the attribute may be dotted, ``module:Class.method``)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"reward function spec {spec!r} must look like 'module:function'")
    module_name, attribute_path = spec.split(":")
    if not module_name or not attribute_path:
        raise ValueError(f"reward function spec {spec!r} must look like 'module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # a missing module, a syntax error, code that raises or exits
        raise ValueError(
            f"reward function spec {spec!r}: cannot import module {module_name!r} ({type(error).__name__}: "
            f"{first_line(error)})"
        ) from None
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise ValueError(
                f"reward function spec {spec!r}: {module_name!r} has no attribute {attribute_path!r}"
            )
        target = getattr(target, attribute)
    if not callable(target):
        # ValueError like every other bad spec: the config value is wrong, whatever its cause.
        raise ValueError(f"reward function spec {spec!r}: {attribute_path!r} is not callable")  # noqa: TRY004
    return target


@register("reward", "python")
class PythonFunctionReward(Reward):
    """Call a Python function on the batch: ``fn(prompts, responses, **kwargs)``.

    Config fields:
        function: ``"module:function"``, imported with importlib (the module must be importable, e.g.
            from the working folder or an installed package). Required.
        kwargs: optional mapping of extra keyword arguments passed to the function.

    The data's columns (a ground-truth ``answer``, ...) are passed too, one list per column, as TRL passes
    dataset columns: every column to a function with ``**kwargs``, else those it names as parameters.

    The function returns a sequence, array or tensor of N floats, one per response; any other count
    raises ValueError. This executes user code by design; the spec is only ever taken from the config.
    """

    name = "python"
    config_fields = ("function", "kwargs")
    reads_columns = True

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        self.spec = self.option("function")
        self.function = load_function(self.spec)
        self.kwargs = dict(self.option("kwargs", {}))
        parameters = list(inspect.signature(self.function).parameters.values())
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        # the parameters after (prompts, responses) that a column may fill
        self.named = {p.name for p in parameters[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def score(self, prompts: list[str], responses: list[str], **columns: Any) -> RewardOutput:
        columns = {k: v for k, v in columns.items() if self.takes_all or k in self.named}
        values = self.function(prompts, responses, **{**columns, **self.kwargs})
        return RewardOutput(scores=as_scores(values, len(responses), f"reward function {self.spec!r}"))
