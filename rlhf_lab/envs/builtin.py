"""Built-in environments that show the protocol at work: a feedback game and a calculator-tool task.

Both make their own tasks from the prompt group's seed (the data's prompts only count and seed them), so a run
needs no dataset, and both reward themselves with a verifiable answer.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from rlhf_lab.envs.base import Environment, EnvState, Message, StepResult
from rlhf_lab.envs.tools import ToolEnvironment
from rlhf_lab.registry import register

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def last_number(text: str) -> float | None:
    """The last number written in ``text``, or None."""
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


@register("env", "guess_number")
class GuessNumber(Environment):
    """Guess a secret whole number in [``low``, ``high``] (drawn from the episode's seed); after each wrong guess the
    environment says "Higher." or "Lower.". A correct guess at turn k scores ``turn_discount``^(k−1) and ends the
    episode; a message without a number is told to answer with one. Logs ``env/solved``."""

    name = "guess_number"

    def _secret(self, seed: int) -> int:
        return random.Random(seed).randint(int(self.option("low", 1)), int(self.option("high", 16)))

    def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        low, high = int(self.option("low", 1)), int(self.option("high", 16))
        return [{"role": "user", "content": f"I am thinking of a whole number from {low} to {high}. Guess it: reply "
                                            "with the number only. After each guess I say higher or lower."}]

    def step(self, assistant_message: str, state: EnvState) -> StepResult:
        guess, secret = last_number(assistant_message), self._secret(state.seed)
        if guess is None:
            return StepResult([{"role": "user", "content": "Reply with a whole number."}], 0.0, False, {"solved": 0.0})
        if guess == secret:
            reward = float(self.option("turn_discount", 0.8)) ** (state.turn - 1)
            return StepResult(None, reward, True, {"solved": 1.0})
        hint = "Higher." if guess < secret else "Lower."
        return StepResult([{"role": "user", "content": hint}], 0.0, False, {"solved": 0.0})


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "12 * (3 + 4)".
    """
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


@register("env", "calculator")
class Calculator(ToolEnvironment):
    """A seeded arithmetic problem of ``operands`` numbers in [1, ``max_operand``] joined by ``operators``; the model
    may call ``calculate`` and answers in ``<answer>...</answer>`` (else its last number counts). 1 for the right
    value, 0 otherwise. Logs ``env/correct``, ``env/tool_calls``, ``env/tool_errors``."""

    name = "calculator"
    tools = (calculate,)

    def problem(self, seed: int) -> str:
        rng = random.Random(seed)
        numbers = [rng.randint(1, int(self.option("max_operand", 99))) for _ in range(int(self.option("operands", 3)))]
        operators = [rng.choice(str(self.option("operators", "+-*"))) for _ in numbers[1:]]
        return " ".join([str(numbers[0]), *(f"{op} {n}" for op, n in zip(operators, numbers[1:], strict=True))])

    def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        return [{"role": "user", "content": f"What is {self.problem(seed)}? You may use the calculate tool. Give the "
                                            "final answer as <answer>NUMBER</answer>."}]

    def answer(self, assistant_message: str, state: EnvState) -> StepResult:
        marked = _ANSWER.findall(assistant_message)
        given = last_number(marked[-1]) if marked else last_number(assistant_message)
        correct = given is not None and abs(given - float(calculate(self.problem(state.seed)))) < 1e-6
        return StepResult(None, float(correct), True, {"correct": float(correct)})
