"""The hf engine's decode: stop strings end a response (kept in it), every rank's generators are checkpointed,
and the step timer waits for the GPU."""

from __future__ import annotations

import torch

from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.hf import generate
from rlhf_lab.models import loading as models
from rlhf_lab.runtime import timer as records
from rlhf_lab.training.state_encoding import rank_rng_state, set_rank_rng_state


def scripted(tokens: list[int]):
    """A draw that emits ``tokens`` in turn for every row (then the last one again)."""
    def sample(probs: torch.Tensor) -> torch.Tensor:
        step = sample.calls = getattr(sample, "calls", 0) + 1
        return torch.full((probs.shape[0],), tokens[min(step, len(tokens)) - 1], dtype=torch.long)
    return sample


def test_a_stop_string_ends_the_response_and_stays_in_it(compose, tiny_overrides, tiny_tokenizer) -> None:
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    words = tiny_tokenizer(" apple banana cherry date", add_special_tokens=False)["input_ids"]
    assert len(words) == 4
    kwargs = dict(group_size=2, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, max_prompt_tokens=64,
                  keep_logits=False)
    plain = generate(model, tiny_tokenizer, ["Hi"], sample=scripted(words), **kwargs)
    assert plain.response_mask.sum(-1).tolist() == [6.0, 6.0]  # no EOS: the limit
    stopped = generate(model, tiny_tokenizer, ["Hi"], sample=scripted(words), stop=(" banana",), **kwargs)
    assert stopped.response_mask.sum(-1).tolist() == [2.0, 2.0]
    assert tiny_tokenizer.decode(stopped.response_ids[0, :2]) == " apple banana"
    assert stopped.input_ids[0, stopped.prompt_width + 2:].eq(tiny_tokenizer.pad_token_id).all()  # padding after


def test_the_engine_takes_its_stop_strings_from_the_config(compose, tiny_overrides) -> None:
    cfg = compose([*tiny_overrides(None), "generation.stop=['Observation:','</answer>']"])
    assert SamplingSettings.from_config(cfg).stop == ("Observation:", "</answer>")
    assert SamplingSettings.from_config(compose(tiny_overrides(None))).stop == ()


def test_every_rank_s_generators_round_trip() -> None:
    torch.manual_seed(5)
    saved = rank_rng_state()
    first = torch.rand(3)
    set_rank_rng_state(saved)
    assert torch.equal(torch.rand(3), first)
    set_rank_rng_state(saved["cpu"])  # a checkpoint that kept the CPU generator only
    assert torch.equal(torch.rand(3), first)


def test_the_step_timer_waits_for_the_gpu_at_each_phase_boundary(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(records.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(records.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(records.torch.cuda, "synchronize", lambda: calls.append("sync"))
    timer = records.StepTimer()
    with timer.phase("generate"):
        calls.append("work")
    assert calls == ["sync", "work", "sync"] and timer.times["generate"] >= 0


def test_the_stop_string_criteria_cache_keeps_the_last_lists_used(monkeypatch) -> None:
    """Building transformers' StopStringCriteria walks the vocabulary (about a second for SmolLM2's): built once per
    list, the least recently used dropped past ``STOP_CACHE`` (a server's clients may send any lists)."""
    from rlhf_lab.generation import hf

    built = []

    class Criteria:  # StopStringCriteria's contract here: built from a tokenizer and stop strings
        def __init__(self, tokenizer, stop_strings) -> None:
            built.append(tuple(stop_strings))

    class Tokenizer:  # a tokenizer the cache can hold weakly
        pass

    monkeypatch.setattr(hf, "StopStringCriteria", Criteria)
    tokenizer = Tokenizer()
    lists = [(f"stop{i}",) for i in range(hf.STOP_CACHE + 3)]
    for stop in lists:
        hf.stop_strings(tokenizer, stop, 4)
    hf.stop_strings(tokenizer, lists[-1], 4)  # cached: not built again
    assert built == lists and list(hf._STOP_CRITERIA[tokenizer]) == lists[3:]
    hf.stop_strings(tokenizer, lists[3], 4)  # used again: now the most recent
    hf.stop_strings(tokenizer, lists[0], 4)  # dropped earlier: built again, and the least recent goes
    assert built == [*lists, lists[0]] and list(hf._STOP_CRITERIA[tokenizer])[-2:] == [lists[3], lists[0]]
    assert lists[4] not in hf._STOP_CRITERIA[tokenizer] and len(hf._STOP_CRITERIA[tokenizer]) == hf.STOP_CACHE
