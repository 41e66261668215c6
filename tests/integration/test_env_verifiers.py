"""``env=verifiers`` (rlhf_lab/envs/verifiers_env.py): a ``verifiers`` environment's rollouts against the policy served
in-process, the trainer training on the exact token ids the server sampled.

The environment is a ``verifiers`` ``SingleTurnEnv`` defined here: four questions in memory, a rubric rewarding the
response's length in characters. Two training steps of the tiny model; the server's samples are captured where it
samples them, and the trained batch is compared with them id for id, log-prob for log-prob, and its scores with the
rubric's own function. Needs ``verifiers`` 0.3.1 (``make install-verifiers``); the bad-input lines are checked
everywhere (without verifiers, the missing package is the line).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from rlhf_lab.envs import verifiers_env, verifiers_server
from rlhf_lab.errors import EnvError
from rlhf_lab.training.loop import Trainer
from tests.integration.test_serve_security import call

pytestmark = pytest.mark.integration

QUESTIONS = ["Name a colour.", "Say hello.", "Count to three.", "Spell cat."]


def length_reward(completion, **kwargs) -> float:
    """The rubric's function: the response's length in characters, over 10."""
    return len(completion[-1]["content"]) / 10


def make_env():
    """The tiny verifiers environment (``env.id=tests.integration.test_env_verifiers:make_env``)."""
    import verifiers.legacy as vf
    from datasets import Dataset

    dataset = Dataset.from_dict({"question": QUESTIONS, "answer": ["red", "hello", "1 2 3", "c a t"]})
    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[length_reward]))


def make_two_turn_env():
    """A two-turn verifiers environment: after the model's first answer it asks again; rewards the turns taken."""
    import verifiers.legacy as vf
    from datasets import Dataset

    class AskAgain(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Again, shorter."}]

    dataset = Dataset.from_dict({"question": QUESTIONS, "answer": ["red", "hello", "1 2 3", "c a t"]})
    return AskAgain(dataset=dataset, rubric=vf.Rubric(funcs=[length_reward]), max_turns=2)


def make_failing_env():
    """A two-turn environment whose answer to the model raises."""
    import verifiers.legacy as vf
    from datasets import Dataset

    class Broken(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            raise RuntimeError("the tool is down")

    dataset = Dataset.from_dict({"question": QUESTIONS, "answer": ["red", "hello", "1 2 3", "c a t"]})
    return Broken(dataset=dataset, rubric=vf.Rubric(funcs=[length_reward]), max_turns=2)


def capture(monkeypatch) -> tuple[list, list]:
    """(what the server sampled: (prompt ids, sampled ids, log-probs) per request, the batches the runner built)."""
    served: list[tuple[list[int], list[int], list[float]]] = []
    trained: list[tuple[torch.Tensor, ...]] = []
    sample_request = verifiers_server.sample_request

    def sampled(backend, request):
        samples = sample_request(backend, request)
        served.extend((list(request["prompt_ids"][0]), tokens, logprobs) for tokens, logprobs in samples)
        return samples
    monkeypatch.setattr(verifiers_server, "sample_request", sampled)
    play = verifiers_env.VerifiersRunner.run

    def captured_run(self, *args, **kwargs):
        rollout, texts, valid = play(self, *args, **kwargs)
        trained.append((rollout.input_ids.clone(), rollout.attention_mask.clone(), rollout.response_mask.clone(),
                        rollout.logprobs.clone(), rollout.scores.clone(), rollout.prompt_width))
        return rollout, texts, valid
    monkeypatch.setattr(verifiers_env.VerifiersRunner, "run", captured_run)
    return served, trained


def overrides(tiny_overrides, tmp_path: Path, env_id: str) -> list[str]:
    return [*tiny_overrides(tmp_path), "env=verifiers", f"env.id={env_id}", "trainer.max_new_tokens=6",
            "env.max_tokens=32", "trainer.eval_every=0", "trainer.eval_prompts=0"]


@pytest.mark.extra("verifiers")
def test_the_trainer_trains_on_the_ids_the_server_sampled(compose, tiny_overrides, tmp_path: Path,
                                                          monkeypatch) -> None:
    served, trained = capture(monkeypatch)
    trainer = Trainer(compose(overrides(tiny_overrides, tmp_path, f"{__name__}:make_env")), tmp_path / "run")
    tokenizer = trainer.tokenizer
    trainer.train()

    assert len(trained) == 2 and len(served) == 2 * 4  # 2 steps x (2 prompts x group of 2), one request each
    by_ids = {(tuple(prompt), tuple(tokens)): logprobs for prompt, tokens, logprobs in served}
    assert len(by_ids) == len(served)  # every sample told apart by its ids
    step_means = []
    for input_ids, attention, mask, logprobs, scores, width in trained:
        for row in range(input_ids.shape[0]):
            prompt = input_ids[row, :width][attention[row, :width].bool()].tolist()
            length = int(mask[row].sum())
            response = input_ids[row, width:width + length].tolist()
            assert (tuple(prompt), tuple(response)) in by_ids  # the server's very ids: prompt and completion
            assert logprobs[row, :length].tolist() == pytest.approx(by_ids[tuple(prompt), tuple(response)], abs=1e-6)
            text = tokenizer.decode(response, skip_special_tokens=True)
            assert float(scores[row]) == pytest.approx(len(text) / 10)  # the rubric's reward of what was sampled
        step_means.append(float(scores.mean()))
    opened = {tuple(prompt) for prompt, _, _ in served}
    expected_openings = {tuple(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                             add_generation_prompt=True, return_dict=True)["input_ids"])
                         for q in QUESTIONS}
    assert opened <= expected_openings  # the environment's own questions, not the data's prompts

    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    assert rewards == pytest.approx(step_means)
    assert all("env/length_reward" in m for m in metrics if "reward/mean" in m)


@pytest.mark.extra("verifiers")
def test_an_unknown_environment_is_one_line(compose, tiny_overrides, tmp_path: Path) -> None:
    with pytest.raises(EnvError, match=r"env.id='no_such_env' is not an installed verifiers environment.*"
                                       r"make install-verifiers"):
        Trainer(compose(overrides(tiny_overrides, tmp_path, "no_such_env")), tmp_path / "run")
    with pytest.raises(EnvError, match=r"env.id='tests.nowhere:make_env' cannot be imported"):
        Trainer(compose(overrides(tiny_overrides, tmp_path, "tests.nowhere:make_env")), tmp_path / "run")


@pytest.mark.extra("verifiers")
def test_a_failing_rollout_is_one_line_or_left_out(compose, tiny_overrides, tmp_path: Path) -> None:
    failing = [*overrides(tiny_overrides, tmp_path, f"{__name__}:make_failing_env"), "trainer.steps=1"]
    with pytest.raises(EnvError, match="^" + re.escape(f"env=verifiers env.id={__name__}:make_failing_env ") +
                                       r"rollout of train prompt \d+ \(row \d\) raised RuntimeError: the tool is down$"):
        Trainer(compose(failing), tmp_path / "run").train()
    with pytest.raises(EnvError, match=r"every one of the 4 samples failed"):  # on_error=drop: nothing left to train
        Trainer(compose([*failing, "env.on_error=drop"]), tmp_path / "drop").train()


def test_without_verifiers_the_run_says_how_to_install_it(compose, tiny_overrides, tmp_path: Path,
                                                          monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers.legacy", None)  # as where verifiers is not installed (CI)
    with pytest.raises(EnvError, match=r"env=verifiers needs the verifiers package \(0\.3\.1\).*"
                                       r"`make install-verifiers`"):
        Trainer(compose(overrides(tiny_overrides, tmp_path, "anything")), tmp_path / "run")


@pytest.mark.extra("verifiers")
def test_a_multi_turn_trajectory_is_the_servers_ids_with_the_environments_tokens_out_of_the_loss(
        compose, tiny_overrides, tmp_path: Path, monkeypatch) -> None:
    served, trained = capture(monkeypatch)
    cfg = compose([*overrides(tiny_overrides, tmp_path, f"{__name__}:make_two_turn_env"), "trainer.steps=1",
                   "env.max_tokens=64"])
    Trainer(cfg, tmp_path / "run").train()

    (input_ids, attention, mask, logprobs, scores, width), = trained
    assert len(served) == 2 * input_ids.shape[0]  # two turns per sample
    for row in range(input_ids.shape[0]):
        sequence = input_ids[row][attention[row].bool()].tolist()
        second = [s for s in served if s[0] + s[1] == sequence]
        assert len(second) == 1  # the whole trajectory is the second turn's prompt and sample, as served
        prompt2, tokens2, logprobs2 = second[0]
        first = [s for s in served if prompt2[:len(s[0]) + len(s[1])] == s[0] + s[1] and s is not second[0]]
        prompt1, tokens1, logprobs1 = first[0]
        env_tokens = len(prompt2) - len(prompt1) - len(tokens1)
        assert env_tokens > 0 and sequence[:len(prompt1)] == prompt1
        length = len(sequence) - len(prompt1)
        expected_mask = [1.0] * len(tokens1) + [0.0] * env_tokens + [1.0] * len(tokens2)
        assert mask[row, :length].tolist() == expected_mask  # the environment's tokens out of the loss
        assert logprobs[row, :length].tolist() == pytest.approx(logprobs1 + [0.0] * env_tokens + logprobs2, abs=1e-6)


def test_the_in_process_server_keeps_the_trust_rules_and_serves_only_in_a_batch(tiny_tokenizer) -> None:
    server = verifiers_server.PolicyServer(tiny_tokenizer, max_model_len=64)
    url = server.base_url.removesuffix("/v1")
    body = {"model": verifiers_server.SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "return_token_ids": True}
    try:
        assert call(url, "/v1/chat/completions", body)[0] == 401  # no token
        assert call(url, "/v1/chat/completions", body, "wrong")[0] == 401
        assert call(url, "/v1/chat/completions", body, server.token, content_type="text/plain")[0] == 415
        status, reply = call(url, "/load_weights", {"folder": "x"}, server.token)
        assert status == 404 and "no route /load_weights" in reply["error"]  # only the two OpenAI routes
        status, reply = call(url, "/v1/chat/completions", body, server.token)
        assert status == 503 and "not serving now" in reply["error"]  # between batches: no weights to answer with

        class Backend:  # a batch's engine: two fixed tokens with their log-probs
            def generate(self, prompts, group_size, seeds=None, greedy=False, settings=None):
                from rlhf_lab.generation.rollout import Rollout

                width = len(prompts[0])
                ids = torch.tensor([list(prompts[0]) + [5, 6]])
                return Rollout(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(1, 2),
                               prompt_width=width, group_size=1, logprobs=torch.tensor([[-0.5, -0.25]]),
                               entropy=torch.zeros(1, 2))

        with server.serving(Backend()):
            status, reply = call(url, "/v1/chat/completions", body, server.token)
        assert status == 200 and reply["choices"][0]["token_ids"] == [5, 6]
        assert [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]] == [-0.5, -0.25]
    finally:
        server.close()


def test_the_shipped_example_s_rubric_by_hand() -> None:
    """``examples/verifiers_env.py``'s reward functions, on chat completions (no verifiers needed)."""
    from examples.verifiers_env import correct_sum, short_answer

    def said(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    assert correct_sum(said("7"), answer="7") == 1.0 and correct_sum(said("3 + 4 = 7"), answer="7") == 1.0
    assert correct_sum(said("7, no 8"), answer="7") == 0.0 and correct_sum(said("seven"), answer="7") == 0.0
    assert short_answer(said(" 12 ")) == 1.0 and short_answer(said("the answer is 12")) == 0.0


@pytest.mark.extra("verifiers")
def test_the_shipped_example_environment_trains(compose, tiny_overrides, tmp_path: Path) -> None:
    """``env.id=examples.verifiers_env:load_environment`` with its arguments: two steps, each rubric function logged,
    the sample's reward their weighted sum (each function is 0 or 1)."""
    cfg = compose([*overrides(tiny_overrides, tmp_path, "examples.verifiers_env:load_environment"),
                   "+env.args.count=8", "+env.args.seed=3"])
    Trainer(cfg, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert len(steps) == 2
    for line in steps:
        assert 0.0 <= line["env/correct_sum"] <= 1.0 and 0.0 <= line["env/short_answer"] <= 1.0
        assert line["reward/mean"] == pytest.approx(line["env/correct_sum"] + 0.2 * line["env/short_answer"])
