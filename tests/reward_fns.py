"""Reward functions for tests of the `python` reward (imported by spec, e.g. ``tests.reward_fns:count_letter``)."""

import torch

NOT_CALLABLE = 3


def count_letter(prompts, responses, letter="a", scale=1.0):
    """scale × occurrences of ``letter`` in each response (a list of floats)."""
    return [scale * response.count(letter) for response in responses]


def prompt_length_tensor(prompts, responses):
    """Length of each prompt in characters, as a float64 tensor (converted to float32 by the reward)."""
    return torch.tensor([len(prompt) for prompt in prompts], dtype=torch.float64)


def one_too_many(prompts, responses):
    return [0.0] * (len(responses) + 1)


def longer_wins(prompt, first, second):
    """A judge: the longer response wins, a tie is even."""
    return 1.0 if len(first) > len(second) else 0.0 if len(first) < len(second) else 0.5


def overconfident(prompt, first, second):
    return 2.0


def constant(prompts, responses):
    """The same score for every response: no group has any reward spread."""
    return [0.5] * len(responses)
