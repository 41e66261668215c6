"""The input embedding's gradient by rows on the embedded SmolLM2-135M in float32 (its embedding tied to the LM
head): with the head's products tapped, the gradients of a shared-prompt training pass, with the norms and MLPs
recomputed as the Updater runs them, equal the plain pass's bit for bit."""

from __future__ import annotations

import torch

from rlhf_lab.hardware.embedding_grad import embedding_by_rows, rows_gradient
from rlhf_lab.models import loading as models
from rlhf_lab.models.recompute import recompute_modules, recomputing
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs

PROMPT, RESPONSE = 6, 5


def test_the_embedded_model_gets_the_plain_gradients_bit_for_bit(compose) -> None:
    cfg = compose(["model=smollm2_135m", "trainer.precision=fp32"])
    tokenizer = models.load_tokenizer(cfg.model)
    model = models.load_causal_lm(cfg.model, tokenizer, "float32", 0)
    plan = embedding_by_rows(model, autocast=False)
    assert plan.head is model.get_output_embeddings() and plan.head.weight is plan.embedding.weight  # tied
    recompute = recompute_modules(model, cfg.trainer, auto=True)
    assert recompute  # the norms and MLPs of every layer, as in the Updater's full fine-tuning
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):  # two micro-batches: the second adds onto the first's gradient
        prompts = torch.randint(100, 2000, (2, PROMPT), generator=generator)
        responses = torch.randint(100, 2000, (4, RESPONSE), generator=generator)
        responses[1:3, :2] = prompts[0, :2]  # tokens repeated across prompts and responses
        mask = torch.ones(4, PROMPT + RESPONSE, dtype=torch.long)
        mask[:2, :2] = 0  # the first prompt left-padded
        batches.append((torch.cat([prompts.repeat_interleave(2, dim=0), responses], dim=1), mask))

    def gradients(rows) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for input_ids, mask in batches:
            with rows_gradient(rows), recomputing(recompute):
                logits, _ = response_logits(model, input_ids, mask, PROMPT, 0.9)
                loss = (gather_logprobs(logits, input_ids[:, PROMPT:]) * torch.linspace(1, 2, RESPONSE)).sum()
                loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain, by_rows = gradients(None), gradients(plan)
    for name, grad in plain.items():
        assert torch.equal(grad, by_rows[name]), name
    assert plain["model.embed_tokens.weight"].abs().max() > 0
