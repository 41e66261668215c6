"""Log-probs, entropy and exact KL from the hidden states in LM-head chunks (rlhf_lab/scoring/head.py): the
unchunked values and gradients to fp32 tolerance, and no [B, T, V] tensor made in any pass or in the decode."""

from __future__ import annotations

import pytest
import torch
from conftest import SCORED_PROMPT, scoring_batch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.decode import decode
from rlhf_lab.kl.exact import exact_kl
from rlhf_lab.models import loading as models
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.head import HeadLogits
from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs, scale_logits
from rlhf_lab.step.compute import (
    GPU_TOKEN_BUDGET,
    gradient_checkpointing,
    head_chunk,
    micro_batches,
    packs_rows,
    token_budget,
)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, True)])
def test_chunked_values_and_gradients_equal_the_whole_logits(temperature, bias):
    torch.manual_seed(0)
    rows, width, hidden_size, vocab = 3, 7, 8, 50
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    head_bias = torch.randn(vocab, requires_grad=True) if bias else None
    ref_hidden, ref_weight = torch.randn(rows, width, hidden_size, requires_grad=True), torch.randn(vocab, hidden_size)
    tokens = torch.randint(0, vocab, (rows, width))
    lazy = HeadLogits(hidden, weight, head_bias, temperature, chunk=4)
    lazy_ref = HeadLogits(ref_hidden, ref_weight, None, temperature, chunk=3)

    def whole() -> torch.Tensor:
        return scale_logits(torch.nn.functional.linear(hidden, weight, head_bias), temperature)

    def whole_ref() -> torch.Tensor:
        return scale_logits(ref_hidden @ ref_weight.T, temperature)

    inputs = [t for t in (hidden, weight, head_bias, ref_hidden) if t is not None]
    cases = {"logprobs": (lambda: gather_logprobs(lazy, tokens), lambda: gather_logprobs(whole(), tokens)),
             "entropy": (lambda: entropy_from_logits(lazy), lambda: entropy_from_logits(whole())),
             "kl": (lambda: exact_kl(lazy, lazy_ref), lambda: exact_kl(whole(), whole_ref())),
             "kl_mixed": (lambda: exact_kl(whole(), lazy_ref), lambda: exact_kl(whole(), whole_ref()))}
    upstream = torch.linspace(0.5, 2.0, rows * width).reshape(rows, width)
    for name, (chunked, plain) in cases.items():
        values, expected = chunked(), plain()
        assert values.shape == (rows, width), name
        assert close(values, expected), name
        grads = torch.autograd.grad((values * upstream).sum(), inputs, allow_unused=True)
        expected_grads = torch.autograd.grad((expected * upstream).sum(), inputs, allow_unused=True)
        for got, want in zip(grads, expected_grads, strict=True):
            assert (got is None) == (want is None), name
            assert got is None or close(got, want), name


def test_no_tensor_grows_with_rows_times_vocabulary():
    torch.manual_seed(0)
    rows, width, hidden_size, vocab, chunk = 4, 32, 8, 300, 16
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width))
    lazy = HeadLogits(hidden, weight, chunk=chunk)
    ref = HeadLogits(torch.randn(rows, width, hidden_size), torch.randn(vocab, hidden_size), chunk=chunk)
    with LargestTensor() as tracked:
        loss = gather_logprobs(lazy, tokens).sum() + entropy_from_logits(lazy).sum() + exact_kl(lazy, ref).sum()
        loss.backward()
    assert tracked.largest <= max(chunk * vocab, vocab * hidden_size) < rows * width * vocab
    with LargestTensor() as whole:  # the unchunked path does make [B, T, V] tensors: the check can fail
        gather_logprobs(hidden @ weight.T, tokens).sum().backward()
    assert whole.largest >= rows * width * vocab


@pytest.mark.parametrize("share_prompts", [True, False])
def test_scoring_pass_through_head_chunks_equals_the_whole_logits(compose, tiny_overrides, tiny_tokenizer,
                                                                  share_prompts):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    reference = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=1)
    input_ids, mask = scoring_batch(500)
    tokens = input_ids[:, SCORED_PROMPT:]

    def run(chunk: int):
        model.zero_grad(set_to_none=True)
        logits, _ = response_logits(model, input_ids, mask, SCORED_PROMPT, 0.8, share_prompts=share_prompts,
                                    head_chunk=chunk)
        with torch.no_grad():
            ref_logits, _ = response_logits(reference, input_ids, mask, SCORED_PROMPT, 0.8,
                                            share_prompts=share_prompts, head_chunk=chunk)
        logprobs, entropy = gather_logprobs(logits, tokens), entropy_from_logits(logits)
        kl = exact_kl(logits, ref_logits)
        (logprobs.sum() + 0.3 * entropy.sum() + 0.5 * kl.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return logits, [logprobs.detach(), entropy.detach(), kl.detach()], grads

    lazy, lazy_values, lazy_grads = run(chunk=5)
    whole, values, grads = run(chunk=0)
    assert isinstance(lazy, HeadLogits) and lazy.shape == whole.shape and isinstance(whole, torch.Tensor)
    for got, want in zip(lazy_values, values, strict=True):
        assert close(got, want)
    for name, grad in grads.items():
        assert close(lazy_grads[name], grad), name


def test_a_lora_wrapped_head_is_chunked_with_its_adapter(compose, tiny_overrides, tiny_tokenizer):
    """``model.lora.target_modules`` naming ``lm_head``: the chunked head adds the adapter's ``scale · B A h`` as
    peft's layer does, so the policy's log-probs, entropy and exact KL and their gradients (the adapter's A and B
    among them) are the whole logits', and the reference's pass (the adapter disabled) is the base head's."""
    from types import SimpleNamespace

    from rlhf_lab.scoring.forward import head_parts, plain_head

    base = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    lora = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
    model = models.apply_lora(base, lora)
    head = plain_head(model)
    assert head is model.get_output_embeddings() and head_parts(head)[1] is not None  # the wrapper, its adapter
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero: an adapter that has trained
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    input_ids, mask = scoring_batch(500)
    tokens = input_ids[:, SCORED_PROMPT:]

    def run(chunk: int):
        model.zero_grad(set_to_none=True)
        logits, _ = response_logits(model, input_ids, mask, SCORED_PROMPT, 0.8, head_chunk=chunk)
        with torch.no_grad(), model.disable_adapter():
            ref_logits, _ = response_logits(model, input_ids, mask, SCORED_PROMPT, 0.8, head_chunk=chunk)
        logprobs, entropy = gather_logprobs(logits, tokens), entropy_from_logits(logits)
        kl = exact_kl(logits, ref_logits)
        (logprobs.sum() + 0.3 * entropy.sum() + 0.5 * kl.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        return logits, ref_logits, [logprobs.detach(), entropy.detach(), kl.detach()], grads

    lazy, lazy_ref, lazy_values, lazy_grads = run(chunk=5)
    whole, whole_ref, values, grads = run(chunk=0)
    assert isinstance(lazy, HeadLogits) and lazy.lora is not None and lazy_ref.lora is None
    assert values[2].abs().max() > 1e-4  # the adapter moved the policy off the reference
    for got, want in zip(lazy_values, values, strict=True):
        assert close(got, want)
    assert any("lm_head.lora_B" in name for name in grads)
    for name, grad in grads.items():
        assert close(lazy_grads[name], grad), name
    assert close(lazy_ref.materialize(), whole_ref)
    model.train()
    model.base_model.model.lm_head.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert plain_head(model) is None  # a dropout mask per recomputed chunk would differ: the whole logits then
    model.eval()
    assert plain_head(model) is head


def test_decode_keeps_the_head_s_inputs_not_a_vocabulary_buffer(compose, tiny_overrides, tiny_tokenizer):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0).eval()
    input_ids, mask = scoring_batch(500)
    prompt_ids, prompt_mask = input_ids[:, :SCORED_PROMPT], mask[:, :SCORED_PROMPT]

    def sample(chunk: int):
        torch.manual_seed(3)
        return decode(model, prompt_ids, prompt_mask, None, 0, max_new_tokens=6, temperature=0.7, top_p=1.0,
                      top_k=0, eos_token_id=None, pad_token_id=0, keep_logits=True, head_chunk=chunk)

    lazy, whole = sample(chunk=4), sample(chunk=0)
    assert torch.equal(lazy.response_ids, whole.response_ids)
    assert isinstance(lazy.logits, HeadLogits) and lazy.logits.hidden.shape[:2] == whole.logits.shape[:2]
    assert close(lazy.logits.materialize(), whole.logits)
    assert close(gather_logprobs(lazy.logits, lazy.response_ids), lazy.logprobs)
    assert close(exact_kl(lazy.logits, whole.logits), torch.zeros_like(lazy.logprobs), tol=1e-5)


def test_compute_defaults_by_device(compose, tiny_overrides):
    trainer = compose(tiny_overrides(None)).trainer
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # The CPU keeps what is fastest there: whole logits, no checkpointing, micro-batches by rows, padded.
    assert (head_chunk(trainer, cpu), gradient_checkpointing(trainer, cpu), token_budget(trainer, cpu),
            packs_rows(trainer, cpu)) == (0, False, 0, False)
    assert (head_chunk(trainer, cuda), gradient_checkpointing(trainer, cuda), token_budget(trainer, cuda),
            packs_rows(trainer, cuda, "flash_attention_2")) == (trainer.lm_head_chunk, True, GPU_TOKEN_BUDGET, True)
    # Packed under SDPA or eager attention, N tokens attend through a dense [N, N] mask: padded rows instead.
    assert not packs_rows(trainer, cuda, "sdpa") and not packs_rows(trainer, cuda, "eager")
    assert not packs_rows(trainer, cuda, None) and not packs_rows(trainer, cpu, "flash_attention_2")
    trainer.pack_rows = True  # asked for: packed whatever the attention
    assert packs_rows(trainer, cpu, "sdpa") and packs_rows(trainer, cuda, None)
    trainer.pack_rows = None
    trainer.chunked_logprobs, trainer.max_tokens_per_micro_batch, trainer.gradient_checkpointing = True, 0, False
    assert (head_chunk(trainer, cpu), token_budget(trainer, cuda), gradient_checkpointing(trainer, cuda)) == \
        (trainer.lm_head_chunk, 0, False)


def test_a_default_budget_stretches_to_the_longest_row_and_a_set_one_does_not():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0]])  # rows of 3, 4 and 2 tokens
    assert [g.tolist() for g in micro_batches(mask, 0, 3, agree=False, stretch=True)] == [[0], [1], [2]]
    assert [g.tolist() for g in micro_batches(mask, 0, 6, agree=False)] == [[0], [1, 2]]
    assert [g.tolist() for g in micro_batches(mask, 2, 0, agree=False)] == [[0, 1], [2]]
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=3 is smaller than the longest row"):
        micro_batches(mask, 0, 3, agree=False)


def test_a_padded_pass_counts_the_positions_it_computes():
    """Padded micro-batches keep the batch's width: rows of 5, 2 and 2 attended tokens in a width of 8 are 8
    positions each, so a 16-token budget holds 2 of them (packed, all 3: 9 tokens)."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]])
    assert [g.tolist() for g in micro_batches(mask, 0, 16, agree=False, padded=True)] == [[0, 1], [2]]
    assert [g.tolist() for g in micro_batches(mask, 0, 16, agree=False)] == [[0, 1, 2]]


def test_the_attention_implementation_is_read_through_a_wrapper():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_lab.step.compute import attention_implementation

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32, vocab_size=32))
    wrapper = torch.nn.Module()
    wrapper.module = model  # as DistributedDataParallel holds it
    assert attention_implementation(model) == attention_implementation(wrapper) == "sdpa"
    assert attention_implementation(torch.nn.Linear(2, 2)) is None
