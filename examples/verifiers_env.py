"""A ``verifiers`` environment to train on as it is: single-turn sums of two digits, scored by a rubric.

    make install-verifiers
    .venv-verifiers/bin/python -m rlhf_lab env=verifiers env.id=examples.verifiers_env:load_environment \\
        trainer.max_new_tokens=16 env.max_tokens=32 +env.args.count=64 +env.args.seed=0

Run from the repository's root (``examples`` is found on the working folder). The dataset is made here, in memory:
``count`` questions "What is a + b? Answer with the number only." with a, b in 0..9 drawn from ``seed``. The rubric
has two functions, each logged as ``env/<function>`` and summed into the sample's reward (weights 1 and 0.2):

- ``correct_sum``: 1 where the response's last number is the sum, else 0;
- ``short_answer``: 1 where the response is at most 8 characters (the number alone), else 0.

It is the shape of a verifiers environment package (a ``load_environment`` taking its arguments), so it is also the
starting point for one's own: change the dataset and the rubric's functions
(docs/guides/environments.md#verifiers-environments).
"""

from __future__ import annotations

import random
import re
from typing import Any

QUESTION = "What is {a} + {b}? Answer with the number only."


def correct_sum(completion: Any, answer: str, **kwargs: Any) -> float:
    """1.0 where the response's last number is ``answer``, else 0.0."""
    numbers = re.findall(r"-?\d+", _text(completion))
    return 1.0 if numbers and numbers[-1] == str(answer) else 0.0


def short_answer(completion: Any, **kwargs: Any) -> float:
    """1.0 where the response is the number alone (at most 8 characters once stripped), else 0.0."""
    return 1.0 if len(_text(completion).strip()) <= 8 else 0.0


def _text(completion: Any) -> str:
    """The last message's text (a chat completion), or the text itself."""
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


def load_environment(count: int = 64, seed: int = 0) -> Any:
    """The environment: ``count`` sums of two digits drawn from ``seed``, the rubric above."""
    import verifiers.legacy as vf
    from datasets import Dataset

    generator = random.Random(seed)
    pairs = [(generator.randint(0, 9), generator.randint(0, 9)) for _ in range(count)]
    dataset = Dataset.from_dict({"question": [QUESTION.format(a=a, b=b) for a, b in pairs],
                                 "answer": [str(a + b) for a, b in pairs]})
    rubric = vf.Rubric(funcs=[correct_sum, short_answer], weights=[1.0, 0.2])
    return vf.SingleTurnEnv(dataset=dataset, rubric=rubric)
