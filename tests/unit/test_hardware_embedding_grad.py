"""The input embedding's gradient added by rows (rlhf_lab/hardware/embedding_grad.py): every gradient equal to the plain
pass's bit for bit, no [V, H] gradient per lookup, and where it stays off."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from rlhf_lab.hardware.embedding_grad import RowsPlan, embedding_by_rows, rows_gradient
from rlhf_lab.models import loading as models
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs

PROMPT, RESPONSE = 5, 4


def tiny_model(compose, tiny_overrides, tokenizer, tied: bool = True) -> LlamaForCausalLM:
    model = models.build_tiny_llama(tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    if not tied:
        model.config.tie_word_embeddings = False
        torch.manual_seed(0)
        model = LlamaForCausalLM(model.config)
    return model


def micro_batch(vocab: int, pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, three sampled rows each (the scoring pass shares each prompt's prefill); the first prompt
    left-padded; tokens repeat within and across prompts and responses."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 40, (2, PROMPT), generator=generator)
    prompts[0, 0] = pad
    responses = torch.randint(3, 40, (6, RESPONSE), generator=generator)
    responses[1, -1] = vocab - 1
    responses[2, 1] = pad  # a real token (EOS is the pad token here) whose lookup the plain pass leaves out too
    mask = torch.ones(6, PROMPT + RESPONSE, dtype=torch.long)
    mask[:3, 0] = 0
    return torch.cat([prompts.repeat_interleave(3, dim=0), responses], dim=1), mask


def training_pass(model: nn.Module, plan: RowsPlan | None, precision: str, micro_batches: int = 2):
    """Gradients by name after accumulating ``micro_batches`` losses over the response log-probs."""
    model.zero_grad(set_to_none=True)
    for seed in range(micro_batches):
        input_ids, mask = micro_batch(model.config.vocab_size, model.config.pad_token_id, seed)
        with rows_gradient(plan):
            with Precision(precision, "cpu").autocast():
                logits, _ = response_logits(model, input_ids, mask, PROMPT, 1.0)
            loss = (gather_logprobs(logits, input_ids[:, PROMPT:]) * torch.linspace(1, 2, RESPONSE)).sum()
            loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("tied", "precision"),
                         [(True, "bf16-mixed"), (True, "fp32"), (False, "fp32"), (False, "bf16-mixed")])
def test_gradients_equal_the_plain_pass_bit_for_bit(compose, tiny_overrides, tiny_tokenizer, tied, precision):
    model = tiny_model(compose, tiny_overrides, tiny_tokenizer, tied)
    plan = embedding_by_rows(model, autocast=precision == "bf16-mixed")
    assert plan.embedding is model.get_input_embeddings()
    # The tied head is tapped only without autocast (its products' gradients then join the rows' ordered sum).
    assert plan.head is (model.get_output_embeddings() if tied and precision == "fp32" else None)
    assert plan.embedding.padding_idx == model.config.pad_token_id  # the pad token's lookups get no gradient
    plain = training_pass(model, None, precision)
    by_rows = training_pass(model, plan, precision)
    assert plain.keys() == by_rows.keys() and len(plain) == len(list(model.parameters()))
    for name, grad in plain.items():
        assert torch.equal(grad, by_rows[name]), name
    assert by_rows["model.embed_tokens.weight"].stride() == model.get_input_embeddings().weight.stride()
    # The class's lookup and product again after the pass.
    assert "forward" not in plan.embedding.__dict__ and "forward" not in model.get_output_embeddings().__dict__


class _LargestGradient(TorchDispatchMode):
    """The most rows of any tensor ``embedding_dense_backward`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.rows = max(self.rows, out.shape[0])
        return out


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_no_lookup_makes_a_vocabulary_sized_gradient(compose, tiny_overrides, tiny_tokenizer, precision):
    model = tiny_model(compose, tiny_overrides, tiny_tokenizer)
    seen = {}
    for name, plan in (("plain", None), ("rows", embedding_by_rows(model, autocast=precision == "bf16-mixed"))):
        with _LargestGradient() as mode:
            training_pass(model, plan, precision, micro_batches=1)
        seen[name] = mode.rows
    assert seen["plain"] == model.config.vocab_size
    assert 0 < seen["rows"] < 40  # the distinct tokens of the batch, not the vocabulary


def test_where_it_stays_off(compose, tiny_overrides, tiny_tokenizer):
    tied = tiny_model(compose, tiny_overrides, tiny_tokenizer)
    head = tied.get_output_embeddings()
    # Without autocast the tied head's products are tapped: only a plain Linear without hooks.
    assert embedding_by_rows(tied, autocast=False).head is head
    handle = head.register_forward_hook(lambda module, args, output: output)
    assert embedding_by_rows(tied, autocast=False) is None
    assert embedding_by_rows(tied, autocast=True).head is None  # under autocast the head is not tapped
    handle.remove()
    weight = tied.get_input_embeddings().weight
    handle = weight.register_hook(lambda grad: grad)  # something reads the gradient during the backward pass
    assert embedding_by_rows(tied, autocast=True) is None
    handle.remove()
    assert embedding_by_rows(tied, autocast=True) is not None
    weight.requires_grad_(False)  # frozen (a LoRA run's base model)
    assert embedding_by_rows(tied, autocast=True) is None
    untied = tiny_model(compose, tiny_overrides, tiny_tokenizer, tied=False)
    untied.get_input_embeddings().max_norm = 1.0  # a lookup that renormalises rows
    assert embedding_by_rows(untied, autocast=False) is None


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_a_hook_registered_after_the_plan_sees_autograd_s_gradient(compose, tiny_overrides, tiny_tokenizer,
                                                                    precision):
    model = tiny_model(compose, tiny_overrides, tiny_tokenizer)
    plan = embedding_by_rows(model, autocast=precision == "bf16-mixed")
    weight = plan.embedding.weight
    seen = []
    handle = weight.register_hook(lambda grad: seen.append(grad.clone()))
    by_rows = training_pass(model, plan, precision, micro_batches=1)
    handle.remove()
    plain = training_pass(model, None, precision, micro_batches=1)
    assert len(seen) == 1 and torch.equal(seen[0], plain["model.embed_tokens.weight"])  # the whole gradient
    assert all(torch.equal(grad, by_rows[name]) for name, grad in plain.items())


def test_a_no_op_without_gradients(compose, tiny_overrides, tiny_tokenizer):
    model = tiny_model(compose, tiny_overrides, tiny_tokenizer)
    plan = embedding_by_rows(model, autocast=False)
    with torch.no_grad(), rows_gradient(plan):
        assert "forward" not in plan.embedding.__dict__ and "forward" not in plan.head.__dict__
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert plan.embedding.weight.grad is None
