"""Import every built-in part so its ``@register`` runs; the entry points (CLI, tools, tests) import this once.

The registry itself imports nothing of the package, so this module is the one place that knows the
built-ins. A new estimator, algorithm, reward or tracker is one module listed here plus its config file.
"""

import rlhf_lab.algorithms.advantages  # noqa: F401  (advantage estimators, baselines)
import rlhf_lab.algorithms.base  # noqa: F401  (the composed algorithms, loss aggregations)
import rlhf_lab.algorithms.losses  # noqa: F401  (policy losses)
import rlhf_lab.algorithms.ppo  # noqa: F401
import rlhf_lab.envs.base  # noqa: F401  (environments: single_turn)
import rlhf_lab.envs.builtin  # noqa: F401  (guess_number, calculator)
import rlhf_lab.envs.verifiers_env  # noqa: F401  (verifiers: imports the package only when a run uses it)
import rlhf_lab.generation.hf  # noqa: F401  (generation engines; vllm imports vLLM only when a run uses it)
import rlhf_lab.generation.server  # noqa: F401
import rlhf_lab.generation.vllm  # noqa: F401
import rlhf_lab.kl  # noqa: F401
import rlhf_lab.offline.dpo  # noqa: F401  (offline stages: sft, dpo, reward_model; preference losses)
import rlhf_lab.offline.reward_model  # noqa: F401
import rlhf_lab.offline.sft  # noqa: F401
import rlhf_lab.rewards.classifier  # noqa: F401
import rlhf_lab.rewards.composite  # noqa: F401
import rlhf_lab.rewards.exact_table  # noqa: F401  (the exact task's reward table)
import rlhf_lab.rewards.length  # noqa: F401
import rlhf_lab.rewards.pairwise  # noqa: F401
import rlhf_lab.rewards.python_function  # noqa: F401
import rlhf_lab.rewards.rescale  # noqa: F401  (reward.rescale: none, mode_anchor)
import rlhf_lab.rewards.reward_model  # noqa: F401
import rlhf_lab.rewards.route  # noqa: F401
import rlhf_lab.rewards.sentiment  # noqa: F401
import rlhf_lab.rewards.verifiable  # noqa: F401  (math_verify, reasoning_gym)
import rlhf_lab.testbed.two_turn  # noqa: F401  (env=exact_two_turn)
import rlhf_lab.trackers.base  # noqa: F401
import rlhf_lab.trackers.csv  # noqa: F401
import rlhf_lab.trackers.mlflow  # noqa: F401  (imports mlflow only when a run uses it)
import rlhf_lab.trackers.tensorboard  # noqa: F401
import rlhf_lab.trackers.trackio  # noqa: F401  (imports trackio only when a run uses it)
import rlhf_lab.trackers.wandb  # noqa: F401
