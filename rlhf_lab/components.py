"""Import every built-in part so its ``@register`` runs; the entry points (CLI, tools, tests) import this once.

The registry itself imports nothing of the package, so this module is the one place that knows the
built-ins. A new estimator, algorithm, reward or tracker is one module listed here plus its config file.
"""

from rlhf_lab import kl  # noqa: F401
from rlhf_lab.algorithms import grpo, ppo, reinforce  # noqa: F401
from rlhf_lab.rewards import classifier, composite, length, python_function, reward_model, sentiment  # noqa: F401
from rlhf_lab.trackers import base, wandb  # noqa: F401
