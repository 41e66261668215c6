"""The environment protocol, multi-turn episodes and tools, with a scripted engine: trajectory layout (sampled ids
kept, environment tokens context only), turn rewards, budgets and truncation, failures one line, the chat
template's tokens for environment messages, tool schemas and calls, and the built-in environments' rules."""

from __future__ import annotations

import time

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lab.algorithms.ppo import gae_advantages
from rlhf_lab.envs.base import Environment, EnvState, StepResult, as_step_result
from rlhf_lab.envs.builtin import Calculator, GuessNumber, calculate
from rlhf_lab.envs.chat import ChatFormat
from rlhf_lab.envs.episodes import EpisodeRunner
from rlhf_lab.envs.tools import parse_tool_calls, run_tool_calls, tool_schemas
from rlhf_lab.errors import EnvError
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.rollout import last_token_index, task_token_rewards
from rlhf_lab.generation.vllm import samples_rollout


class ScriptedEngine:
    """Answers every prompt with ``script(prompt ids, sample index)`` token ids (log-prob −0.5 each); records calls."""

    def __init__(self, tokenizer, script) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, group_size, seeds=None, greedy=False, settings=None):
        self.calls.append([list(p) for p in prompts])
        samples = []
        for prompt in prompts:
            for index in range(group_size):
                response = list(self.script(list(prompt), index))[: settings.max_new_tokens]
                samples.append((list(prompt), response, [-0.5] * len(response)))
        return samples_rollout(samples, group_size, self.tokenizer, torch.device("cpu"))


class Countdown(Environment):
    """Turn k's reward is k/10; the episode ends at turn ``stop_at``; the environment's message is "next k"."""

    name = "countdown"

    def reset(self, task, seed):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, assistant_message, state):
        if state.turn >= self.option("stop_at", 2):
            return StepResult(None, state.turn / 10, True)
        return StepResult([{"role": "user", "content": f"next {state.turn}"}], state.turn / 10, False, {"seen": 1})


def env_cfg(**values):
    base = {"name": "countdown", "max_turns": 4, "max_tokens": 200, "stop": [], "step_timeout": 5.0, "workers": 4,
            "on_error": "error", "loss_on_env_tokens": False}
    return OmegaConf.create({**base, **values})


def runner_cfg(env, chat_template=True):
    return OmegaConf.create({"env": env, "model": {"chat_template": chat_template, "system_prompt": None},
                             "trainer": {"seed_per_prompt": False}})


SETTINGS = SamplingSettings(max_new_tokens=6, max_prompt_tokens=256)  # a prompt and the episode's budget


def answer(tokenizer, text):
    return lambda prompt, index: tokenizer(f"{text}{index}", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]


def run(env, tokenizer, script, prompts=("hi",), group=2, cfg=None, settings=SETTINGS):
    runner = EpisodeRunner(env, tokenizer, cfg or runner_cfg(env.cfg))
    engine = ScriptedEngine(tokenizer, script)
    names = [f"train prompt {i}" for i in range(len(prompts))]
    rollout, texts, valid = runner.run(engine, settings, list(prompts), group, [7] * len(prompts), names,
                                       torch.device("cpu"))
    return rollout, texts, valid, engine


def test_a_trajectory_is_the_sampled_ids_and_the_environment_tokens_as_produced(tiny_tokenizer) -> None:
    env = Countdown(env_cfg(stop_at=2))
    rollout, texts, valid, engine = run(env, tiny_tokenizer, answer(tiny_tokenizer, "ok"))
    chat = ChatFormat(tiny_tokenizer, True, None)
    prompt = chat.prompt_ids([{"role": "user", "content": "hi"}])
    turn = [answer(tiny_tokenizer, "ok")(None, i) for i in range(2)]
    between = chat.continuation_ids([{"role": "user", "content": "next 1"}])
    assert engine.calls[0] == [prompt]  # one prompt, two samples
    assert engine.calls[1] == [prompt + turn[0] + between, prompt + turn[1] + between]  # each from its own ids
    for row in range(2):
        expected = turn[row] + between + turn[0]  # the second turn: sample index 0 of a one-sample call
        width = len(expected)
        assert rollout.response_ids[row, :width].tolist() == expected
        model = [1.0] * len(turn[row]) + [0.0] * len(between) + [1.0] * len(turn[0])
        assert rollout.response_mask[row, :width].tolist() == model
        assert rollout.attention_mask[row, rollout.prompt_width :][:width].tolist() == [1] * width
        assert rollout.logprobs[row, :width].tolist() == [-0.5 * m for m in model]
        # turn k's reward k/10 on its last model token; the score is their sum
        ends = [len(turn[row]) - 1, width - 1]
        assert torch.nonzero(rollout.turn_rewards[row]).squeeze(-1).tolist() == ends
        assert rollout.turn_rewards[row, ends].tolist() == pytest.approx([0.1, 0.2])
        assert last_token_index(rollout.response_mask)[row] == width - 1
    assert rollout.scores.tolist() == pytest.approx([0.3, 0.3])
    assert valid.tolist() == [True, True] and rollout.truncated.tolist() == [False, False]
    assert rollout.extras["env/turns_mean"].tolist() == [2.0, 2.0] and rollout.extras["env/seen"].tolist() == [1, 1]
    assert texts[0] == tiny_tokenizer.decode(rollout.response_ids[0, :width].tolist())
    # the task's token rewards are the turn rewards, not the score on the last token
    assert torch.equal(task_token_rewards(rollout, rollout.scores), rollout.turn_rewards)


def test_the_environment_message_tokens_are_what_the_template_renders_after_a_turn(tiny_tokenizer) -> None:
    chat = ChatFormat(tiny_tokenizer, True, None)
    conversation = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "tool", "content": "checked"}]
    whole = tiny_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    sampled = tiny_tokenizer("4", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    pieced = chat.prompt_ids(conversation[:1]) + sampled + chat.continuation_ids(conversation[2:])
    assert pieced == whole  # a template that keeps earlier turns as they were: the same ids either way


REWRITING_TEMPLATE = (  # drops every earlier assistant turn's reasoning, as reasoning models' templates do
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_earlier_turns_does_not_change_the_trained_tokens(tiny_tokenizer) -> None:
    tokenizer = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = REWRITING_TEMPLATE
    thought = tokenizer("<think>carry the one</think>5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rollout, _, _, _ = run(Countdown(env_cfg(stop_at=2)), tokenizer, lambda prompt, index: thought, group=1,
                           settings=SamplingSettings(max_new_tokens=40, max_prompt_tokens=256))
    response = rollout.response_ids[0][rollout.response_mask[0] > 0].tolist()
    assert response == thought + thought  # both turns' sampled ids, the reasoning kept
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": tokenizer.decode(thought[:-1])},
         {"role": "user", "content": "next 1"}], tokenize=False)
    assert "carry the one" not in rendered  # what a re-rendering would have trained on instead


def test_max_turns_and_the_token_budget_end_an_episode_as_truncated(tiny_tokenizer) -> None:
    script = answer(tiny_tokenizer, "ok")
    rollout, _, _, _ = run(Countdown(env_cfg(stop_at=9, max_turns=3)), tiny_tokenizer, script, group=1)
    assert rollout.extras["env/turns_mean"].tolist() == [3.0] and rollout.truncated.tolist() == [True]
    assert rollout.turn_rewards.sum().item() == pytest.approx(0.6)  # turns 1-3 rewarded
    first = len(script(None, 0))
    rollout, _, _, _ = run(Countdown(env_cfg(stop_at=9, max_tokens=first + 2)), tiny_tokenizer, script, group=1)
    assert rollout.extras["env/turns_mean"].tolist() == [1.0] and rollout.truncated.tolist() == [True]
    assert rollout.response_mask.sum().item() == first  # the environment's message did not fit: not appended
    # a turn cut at max_new_tokens without its end token ends the episode, truncated
    endless = lambda prompt, index: tiny_tokenizer("word " * 20, add_special_tokens=False)["input_ids"]  # noqa: E731
    rollout, _, _, _ = run(Countdown(env_cfg(stop_at=2)), tiny_tokenizer, endless, group=1)
    assert rollout.extras["env/turns_mean"].tolist() == [1.0] and rollout.truncated.tolist() == [True]
    assert rollout.response_mask.sum().item() == SETTINGS.max_new_tokens


def test_the_wrong_mask_puts_environment_tokens_in_the_loss(tiny_tokenizer) -> None:
    rollout, _, _, _ = run(Countdown(env_cfg(stop_at=2, loss_on_env_tokens=True)), tiny_tokenizer,
                           answer(tiny_tokenizer, "ok"), group=1)
    assert torch.equal(rollout.response_mask[0] > 0, rollout.attention_mask[0, rollout.prompt_width :] > 0)


class Broken(Countdown):
    def __init__(self, cfg, failure):
        super().__init__(cfg)
        self.failure = failure

    def step(self, assistant_message, state):
        if self.failure == "raise":
            raise KeyError("scoreboard")
        if self.failure == "types":
            return [{"role": "user"}], 1.0, False, {}
        if self.failure == "hang":
            time.sleep(5)
        return super().step(assistant_message, state)


@pytest.mark.parametrize(("failure", "problem"), [
    ("raise", "raised KeyError: 'scoreboard'"),
    ("types", "returned the message {'role': 'user'}; each needs a string 'role' and 'content'"),
    ("hang", "timed out after env.step_timeout=0.2s"),
])
def test_a_failing_environment_is_one_line_naming_it_the_turn_and_the_prompt(tiny_tokenizer, failure,
                                                                              problem) -> None:
    env = Broken(env_cfg(step_timeout=0.2), failure)
    with pytest.raises(EnvError) as raised:
        run(env, tiny_tokenizer, answer(tiny_tokenizer, "ok"), prompts=("tell me a story",), group=1)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("env=countdown turn 1 of train prompt 0 ('tell me a story')")
    assert problem in message


def test_under_on_error_drop_the_failing_sample_leaves_the_batch(tiny_tokenizer) -> None:
    class FailsOnSecondPrompt(Countdown):
        def step(self, assistant_message, state):
            if state.task["prompt"] == "bad":
                raise RuntimeError("no")
            return super().step(assistant_message, state)

    with pytest.warns(UserWarning, match="env.on_error=drop"):
        rollout, _, valid, _ = run(FailsOnSecondPrompt(env_cfg(on_error="drop")), tiny_tokenizer,
                                   answer(tiny_tokenizer, "ok"), prompts=("good", "bad"), group=1)
    assert valid.tolist() == [True, False] and rollout.scores.tolist() == pytest.approx([0.3, 0.0])


def test_step_results_are_checked() -> None:
    assert as_step_result(([{"role": "user", "content": "x"}], 1, False, {"a": 2})).reward == 1.0
    for bad, message in [((None, "1", True, {}), "reward is '1'"), ((None, 1.0, "yes", {}), "done is 'yes'"),
                         ((None, 1.0, True, {"a": "b"}), "info is"), ("text", "step returned str"),
                         (("x", 1.0, True, {}), "returned messages 'x'")]:
        with pytest.raises(ValueError, match=message):
            as_step_result(bad)


# ------------------------------------------------------------------------------------------------------- tools


def test_tool_schemas_come_from_the_signature_and_docstring() -> None:
    (schema,) = tool_schemas([calculate])
    function = schema["function"]
    assert function["name"] == "calculate" and function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"


def test_tool_calls_are_parsed_and_their_failures_become_tool_messages() -> None:
    text = ('Let me compute. <tool_call>{"name": "calculate", "arguments": {"expression": "6 * 7"}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad json</tool_call>'
            '<tool_call>{"name": "calculate", "arguments": {"expression": "1 / 0"}}</tool_call>')
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculate", "nope", None, "calculate"]
    messages, errors = run_tool_calls(calls, {"calculate": calculate})
    assert [m["role"] for m in messages] == ["tool"] * 4 and errors == 3
    assert messages[0]["content"] == "42"
    assert messages[1]["content"].startswith("Error: no tool named 'nope'; tools: calculate")
    assert messages[2]["content"].startswith("Error: the tool call is not JSON")
    assert messages[3]["content"] == "Error: ZeroDivisionError: division by zero"
    assert parse_tool_calls("The answer is 4.") == []


def test_calculate_evaluates_arithmetic_only() -> None:
    assert calculate("12 * (3 + 4)") == "84" and calculate("7 / 2") == "3.5" and calculate("-3 - -4") == "1"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculate("__import__('os').getcwd()")


def test_the_calculator_environment_runs_tools_then_scores_the_answer() -> None:
    env = Calculator(OmegaConf.create({"operands": 3, "max_operand": 20, "operators": "+*"}))
    problem = env.problem(5)
    assert env.problem(5) == problem and env.reset({"prompt": "x"}, 5)[0]["content"].startswith(f"What is {problem}?")
    state = EnvState({"prompt": "x"}, 5, turn=1)
    call = f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{problem}"}}}}</tool_call>'
    result = env.step(call, state)
    assert result.done is False and result.messages[0]["content"] == calculate(problem)
    assert result.info == {"tool_calls": 1.0, "tool_errors": 0.0}
    right = env.step(f"<answer>{calculate(problem)}</answer>", state)
    wrong = env.step("<answer>-1</answer>", state)
    assert (right.reward, right.done, wrong.reward) == (1.0, True, 0.0)
    assert right.info == {"tool_calls": 0.0, "tool_errors": 0.0, "correct": 1.0}


def test_guess_number_answers_higher_or_lower_and_discounts_late_guesses() -> None:
    env = GuessNumber(OmegaConf.create({"low": 1, "high": 16, "turn_discount": 0.5}))
    secret = env._secret(3)
    state = EnvState({"prompt": "x"}, 3, turn=1)
    assert env.step(str(secret - 1) if secret > 1 else "0", state).messages[0]["content"] == "Higher."
    assert env.step(f"My guess: {secret + 1}", state).messages[0]["content"] == "Lower."
    assert env.step("no idea", state).messages[0]["content"] == "Reply with a whole number."
    state.turn = 3
    solved = env.step(str(secret), state)
    assert solved.done and solved.reward == 0.25 and solved.info == {"solved": 1.0}


# --------------------------------------------------------------------------------------------- masks with holes


def test_gae_skips_environment_tokens() -> None:
    """GAE over a trajectory with an environment token between two model tokens equals GAE over the model tokens
    alone (γ = 0.9, λ = 0.8), by hand: A_1 = r_1 − V_1 = 1 − 0.5; A_0 = (0 + 0.9·0.5 − 0.2) + 0.72·0.5 = 0.61."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 9.0, 0.5]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages, returns = gae_advantages(rewards, values, mask, 0.9, 0.8)
    assert advantages.tolist()[0] == pytest.approx([0.61, 0.0, 0.5])
    assert returns.tolist()[0] == pytest.approx([0.81, 0.0, 1.0])
    compact, _ = gae_advantages(rewards[:, [0, 2]], values[:, [0, 2]], mask[:, [0, 2]], 0.9, 0.8)
    assert advantages[0, [0, 2]].tolist() == pytest.approx(compact[0].tolist())


TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
                 "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_reach_the_model_through_the_template_or_the_system_message(tiny_tokenizer) -> None:
    schemas = tool_schemas([calculate])
    question = [{"role": "user", "content": "What is 2+3?"}]
    ignoring = tiny_tokenizer.decode(ChatFormat(tiny_tokenizer, True, "Be brief.", schemas).prompt_ids(question))
    assert "Be brief.\n\nYou can call these tools:\n<tools>\n" in ignoring and '"name": "calculate"' in ignoring
    assert "write <tool_call>" in ignoring  # SmolLM2's template ignores tools=: they go in the system message
    aware = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    aware.chat_template = TOOL_TEMPLATE
    rendered = aware.decode(ChatFormat(aware, True, None, schemas).prompt_ids(question))
    assert rendered.startswith("<|im_start|>system\nTOOLS: calculate<|im_end|>") and "<tools>" not in rendered
