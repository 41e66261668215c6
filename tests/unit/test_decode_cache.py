"""The decode loop's key/value cache: transformers' dynamic cache's numbers, written in place, with the keys
stored in the values' dtype under autocast (the cast attention makes anyway)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import rlhf_lab.generation.hf as hf_module
from rlhf_lab.generation.hf import generate
from rlhf_lab.generation.kv_cache import DecodeLayer, decode_cache
from rlhf_lab.models import loading as models

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def states(generator: torch.Generator, batch: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(batch, 3, length, 8, generator=generator).to(dtype)


def test_the_layer_holds_what_the_dynamic_layer_holds_and_writes_in_place() -> None:
    generator = torch.Generator().manual_seed(0)
    ours, theirs = DecodeLayer(reserve=4), DynamicLayer()
    pointers = set()
    for length in (5, 1, 1, 1, 1, 1):  # a prefill, then one position a step, past the reserve once
        keys, values = states(generator, 2, length, torch.float32), states(generator, 2, length, torch.float32)
        got, want = ours.update(keys, values), theirs.update(keys, values)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pointers.add(ours.keys.data_ptr())
    assert ours.get_seq_length() == theirs.get_seq_length() == 10
    assert len(pointers) == 2  # one buffer for 5 + 4 positions, a second once the tenth arrived
    rows = torch.tensor([1, 1, 0])
    ours.batch_select_indices(rows)
    theirs.batch_select_indices(rows)
    keys, values = states(generator, 3, 1, torch.float32), states(generator, 3, 1, torch.float32)
    got, want = ours.update(keys, values), theirs.update(keys, values)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # new rows: a new buffer, same numbers
    assert ours.keys.data_ptr() not in pointers


def test_under_autocast_keys_are_stored_in_the_values_dtype_outside_it_as_they_come() -> None:
    generator = torch.Generator().manual_seed(1)
    keys, values = states(generator, 2, 3, torch.float32), states(generator, 2, 3, torch.bfloat16)
    with torch.autocast(**AUTOCAST):
        stored_keys, stored_values = DecodeLayer(reserve=2).update(keys, values)
    assert stored_keys.dtype == torch.bfloat16 and torch.equal(stored_keys, keys.to(torch.bfloat16))
    assert torch.equal(stored_values, values)
    stored_keys, _ = DecodeLayer(reserve=2).update(keys, values)
    assert stored_keys.dtype == torch.float32 and torch.equal(stored_keys, keys)


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("autocast", [True, False])
def test_generation_samples_what_it_samples_with_the_dynamic_cache(compose, tiny_overrides, tiny_tokenizer,
                                                                   monkeypatch, share_prompts, autocast) -> None:
    """Shared prompt prefill (the cache indexed out to every row) or not, bf16 autocast or float32: the same
    tokens, logits and log-probs as transformers' dynamic cache, bit for bit."""
    cfg = compose(tiny_overrides(None))
    model = models.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0)
    settings = dict(group_size=3, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, max_prompt_tokens=64,
                    keep_logits=True, share_prompts=share_prompts)
    prompts = ["Hi", "Say something kind about the sea."]

    def sample() -> hf_module.Rollout:
        torch.manual_seed(0)
        with torch.autocast(**AUTOCAST, enabled=autocast):
            return generate(model, tiny_tokenizer, prompts, **settings)

    ours = sample()
    monkeypatch.setattr(hf_module, "decode_cache", lambda reserve: DynamicCache())
    theirs = sample()
    assert torch.equal(ours.input_ids, theirs.input_ids)
    assert torch.equal(ours.policy_logits, theirs.policy_logits)
    assert torch.equal(ours.logprobs, theirs.logprobs)


def test_the_cache_makes_its_layers_with_the_reserve() -> None:
    cache = decode_cache(7)
    generator = torch.Generator().manual_seed(2)
    cache.update(states(generator, 1, 2, torch.float32), states(generator, 1, 2, torch.float32), layer_idx=1)
    assert [type(layer) for layer in cache.layers] == [DecodeLayer, DecodeLayer]
    assert cache.layers[1].buffers[0].shape[-2] == 2 + 7
