"""The decode loop holds nothing once it returns: no step builds an autograd graph, under autocast (bf16-mixed)
or not. A decode step that ran with gradients on kept every step's activations alive (4.7 GiB for a 1B Llama's
16 rows × 64 tokens, about the whole gap a GPU's measured peak showed against the planner's)."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_lab.generation.decode import decode
from rlhf_lab.generation.kv_cache import decode_cache
from rlhf_lab.planner.fake import StepMemory


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()  # its parameters require gradients, as a policy's do


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_a_decode_builds_no_graph_and_leaves_nothing_behind(autocast) -> None:
    model = tiny_llama()
    grad_enabled: list[bool] = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    with StepMemory() as memory:
        memory.track_external(model)
        prompts = torch.randint(3, 96, (4, 5), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(prompts)
        before = memory.start_phase()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            sampled = decode(model, prompts, mask, decode_cache(6), 0, max_new_tokens=6,
                             temperature=0.7, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
        assert sampled.response_ids.shape == (4, 6)
        del sampled
        gc.collect()
        left = memory.current() - before
    assert grad_enabled == [False] * 6  # one forward per step, each without gradients
    assert left == 0
