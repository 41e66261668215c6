"""The decode loop is the same computation as ``model.generate`` plus a fresh forward pass.

For a fixed seed it draws the same tokens as ``generate`` (sampling with temperature, top-k, top-p, greedy;
left-padded prompts; rows that end early), its logits are generate's bit for bit, and its log-probs,
entropies and kept hidden states equal a fresh forward pass over the sampled sequences, on ``model=tiny``
and on the embedded SmolLM2-135M. PPO's sampling-time values read those hidden states and skip their
forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import pytest
import torch
from transformers import DynamicCache

from rlhf_lab.data.prompts import format_prompts
from rlhf_lab.generation.decode import decode
from rlhf_lab.generation.hf import generate
from rlhf_lab.hardware.generation_weights import generation_weights
from rlhf_lab.models import loading as models
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import position_ids_from_mask
from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs
from rlhf_lab.training.loop import Trainer
from tests import fake_vllm

PROMPTS = ["Hi", "Write two honest sentences about a slow but beautiful film about the sea and its sailors."]
GROUP_SIZE = 3
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, compose, tiny_overrides) -> Trainer:
    tmp = tmp_path_factory.mktemp("sampler")
    cfg = compose([*tiny_overrides(tmp), "algorithm=ppo", "algorithm.mini_batch_size=4",
                   f"trainer.max_new_tokens={MAX_NEW_TOKENS}"])
    return Trainer(cfg, tmp / "run")


def encoded_prompts(tokenizer, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    formatted = format_prompts(PROMPTS, tokenizer, True, None)
    encoded = tokenizer(formatted, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (encoded["attention_mask"] == 0).any()  # left padding present
    return (encoded["input_ids"].repeat_interleave(group_size, 0),
            encoded["attention_mask"].repeat_interleave(group_size, 0))


def plain_generate(model, input_ids, attention_mask, eos, pad, greedy=False, **sampling):
    settings = dict(do_sample=False) if greedy else dict(do_sample=True, **sampling)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS,
                          min_new_tokens=1, pad_token_id=pad, eos_token_id=eos, output_logits=True,
                          return_dict_in_generate=True, **settings)


def end_tokens(model) -> list[int]:
    """Every eighth token id ends a row: the near-uniform tiny model then ends most rows early, at random."""
    return list(range(0, model.config.vocab_size, 8))


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "greedy"),
                         [(1.0, 0, 1.0, False), (0.7, 20, 0.9, False), (1.3, 0, 0.8, False), (1.0, 0, 1.0, True)])
def test_decode_draws_what_generate_draws(trainer: Trainer, temperature, top_k, top_p, greedy) -> None:
    model, tokenizer = trainer.policy.eval(), trainer.tokenizer
    input_ids, attention_mask = encoded_prompts(tokenizer)
    sampling = {} if greedy else dict(temperature=temperature, top_k=top_k, top_p=top_p)
    eos = end_tokens(model)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = plain_generate(model, input_ids, attention_mask, eos, tokenizer.pad_token_id, greedy, **sampling)
    after_generate = torch.get_rng_state()
    torch.manual_seed(7)
    got = decode(model, input_ids, attention_mask, DynamicCache(), 0, MAX_NEW_TOKENS, temperature, top_p, top_k,
                 eos, tokenizer.pad_token_id, greedy=greedy, keep_logits=True)
    expected_ids = expected.sequences[:, input_ids.shape[1]:]
    assert torch.equal(got.response_ids, expected_ids)
    assert torch.equal(torch.get_rng_state(), after_generate)  # the same draws, in the same order, no more
    ended = torch.isin(expected_ids[:, :-1], torch.tensor(eos)).any(dim=1)
    assert greedy or (ended.any() and not ended.all())  # rows end early, others go on: finished rows are padded
    assert torch.equal(got.logits, torch.stack(expected.logits, dim=1).float() / temperature)


def test_decode_gives_the_eos_ids_to_its_processors_on_the_prompts_device(trainer: Trainer, monkeypatch) -> None:
    """transformers keeps EOS ids given as ints on the CPU: on a GPU the first step's minimum-length processor then
    compares across devices and the run fails (seen on an H200). decode hands them over as a tensor on the device
    of the prompts."""
    from rlhf_lab.generation import decode as decode_module

    given = []

    class Recording(decode_module.MinNewTokensLengthLogitsProcessor):
        def __init__(self, prompt_width, min_new_tokens, eos_token_id):
            given.append(eos_token_id)
            super().__init__(prompt_width, min_new_tokens, eos_token_id)

    monkeypatch.setattr(decode_module, "MinNewTokensLengthLogitsProcessor", Recording)
    model, tokenizer = trainer.policy.eval(), trainer.tokenizer
    input_ids, attention_mask = encoded_prompts(tokenizer)
    decode(model, input_ids, attention_mask, DynamicCache(), 0, 2, 1.0, 1.0, 0, [5, 9], tokenizer.pad_token_id)
    assert len(given) == 1 and isinstance(given[0], torch.Tensor)
    assert given[0].device == input_ids.device and given[0].tolist() == [5, 9]


def test_decode_that_ends_early_leaves_the_generator_where_generate_leaves_it(trainer: Trainer) -> None:
    """Every row ends before the token limit: the loop stops where generate stops, having drawn exactly what
    generate drew (the generator's state afterwards is the same), and the kept logits are the steps taken."""
    model, tokenizer = trainer.policy.eval(), trainer.tokenizer
    input_ids, attention_mask = encoded_prompts(tokenizer)
    eos, limit = end_tokens(model), 40
    torch.manual_seed(0)
    with torch.no_grad():
        expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=limit,
                                  min_new_tokens=1, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                                  output_logits=True, return_dict_in_generate=True)
    after_generate = torch.get_rng_state()
    torch.manual_seed(0)
    got = decode(model, input_ids, attention_mask, DynamicCache(), 0, limit, 1.0, 1.0, 0, eos,
                 tokenizer.pad_token_id, keep_logits=True)
    assert got.response_ids.shape[1] < limit  # the loop stopped early
    assert torch.equal(got.response_ids, expected.sequences[:, input_ids.shape[1]:])
    assert torch.equal(got.logits, torch.stack(expected.logits, dim=1).float())
    assert torch.equal(torch.get_rng_state(), after_generate)


def test_rollout_quantities_equal_a_fresh_forward_pass(trainer: Trainer) -> None:
    """generate() (shared prompt prefill, decode loop): log-probs, entropy and hidden states against one plain
    forward pass over the finished rows, to 1e-5 absolute plus 1e-5 relative (log-probs near −10.8 here: a
    49,152-token vocabulary)."""
    model, tokenizer = trainer.policy, trainer.tokenizer
    formatted = format_prompts(PROMPTS, tokenizer, True, None)
    torch.manual_seed(0)
    rollout = generate(model, tokenizer, formatted, GROUP_SIZE, MAX_NEW_TOKENS, 0.8, 1.0, 0, 256,
                       keep_logits=True, keep_hidden=True)
    with torch.no_grad():
        output = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                       position_ids=position_ids_from_mask(rollout.attention_mask), output_hidden_states=True)
    width = rollout.prompt_width
    logits = output.logits[:, width - 1 : -1].float() / 0.8
    hidden = output.hidden_states[-1][:, width - 1 : -1]
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.logprobs[mask], gather_logprobs(logits, rollout.response_ids)[mask],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rollout.entropy[mask], entropy_from_logits(logits)[mask],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rollout.hidden[mask], hidden[mask], rtol=0, atol=1e-5)
    assert rollout.hidden.shape == (*rollout.response_mask.shape, model.config.hidden_size)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_what_generation_returns_holds_no_inference_tensor(trainer: Trainer, precision: str) -> None:
    """The decode's model calls run in inference mode without autocast; nothing they make is returned as an
    inference tensor (autograd would refuse to save one, and it cannot be changed in place outside inference
    mode), and the kept log-probs and hidden states still feed a pass with gradients."""
    formatted = format_prompts(PROMPTS, trainer.tokenizer, True, None)
    with Precision(precision, "cpu").autocast():
        rollout = generate(trainer.policy, trainer.tokenizer, formatted, GROUP_SIZE, MAX_NEW_TOKENS, 1.0, 1.0, 0,
                           256, keep_logits=True, keep_hidden=True)
    tensors = {f.name: getattr(rollout, f.name) for f in fields(rollout)}
    tensors = {name: value for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    assert {"input_ids", "logprobs", "entropy", "policy_logits", "hidden"} <= tensors.keys()
    assert not [name for name, value in tensors.items() if value.is_inference()]
    weight = torch.ones(rollout.hidden.shape[-1], requires_grad=True)
    ((rollout.hidden.float() @ weight) * rollout.logprobs).sum().backward()  # both saved for backward
    assert weight.grad is not None


def test_without_keep_flags_nothing_large_is_kept(trainer: Trainer) -> None:
    formatted = format_prompts(PROMPTS, trainer.tokenizer, True, None)
    rollout = generate(trainer.policy, trainer.tokenizer, formatted, GROUP_SIZE, MAX_NEW_TOKENS, 1.0, 1.0, 0, 256,
                       keep_logits=False)
    assert rollout.policy_logits is None and rollout.hidden is None


def test_ppo_sampling_values_read_the_kept_hidden_states_without_a_forward_pass(trainer: Trainer) -> None:
    algorithm = trainer.algorithm
    assert algorithm.reads_sampling_hidden and trainer.experience.engine.keep_hidden
    formatted = format_prompts(PROMPTS, trainer.tokenizer, True, None)
    torch.manual_seed(0)
    rollout = generate(trainer.policy, trainer.tokenizer, formatted, GROUP_SIZE, MAX_NEW_TOKENS, 1.0, 1.0, 0, 256,
                       keep_logits=False, keep_hidden=True)
    with torch.no_grad():  # a critic whose values are not all zero (it starts at zero)
        for parameter in algorithm.critic.parameters():
            parameter.copy_(torch.linspace(-1, 1, parameter.numel()).reshape(parameter.shape))
    calls = []

    def forward(batch):
        calls.append(batch)
        return trainer.updater.forward(batch)

    with torch.no_grad():
        from_hidden = algorithm.sampling_values(rollout, forward)
        assert not calls
        from_forward = algorithm.sampling_values(dataclasses.replace(rollout, hidden=None), forward)
    assert len(calls) == 1 and from_hidden.abs().max() > 1e-3
    torch.testing.assert_close(from_hidden, from_forward, rtol=0, atol=1e-5)


def test_the_embedded_model_draws_what_generate_draws_and_scores_as_a_forward_pass(compose) -> None:
    """SmolLM2-135M (fp32): the same tokens as generate; log-probs of a fresh forward pass to 1e-5 absolute
    plus 1e-5 relative (a log-prob of −10 carries float32 rounding of a 30-layer network), of the distribution the
    tokens were drawn from: softmax(logits / 0.7) truncated to top-k 50, then top-p 0.95, renormalised (vLLM's rule,
    the stand-in's independent implementation of it)."""
    model_cfg = compose(["model=smollm2_135m"]).model
    tokenizer = models.load_tokenizer(model_cfg)
    model = models.load_causal_lm(model_cfg, tokenizer, "float32", 0).eval()
    input_ids, attention_mask = encoded_prompts(tokenizer, group_size=2)
    torch.manual_seed(3)
    with torch.no_grad():
        expected = plain_generate(model, input_ids, attention_mask, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                  temperature=0.7, top_k=50, top_p=0.95)
    torch.manual_seed(3)
    got = decode(model, input_ids, attention_mask, DynamicCache(), 0, MAX_NEW_TOKENS, 0.7, 0.95, 50,
                 tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert torch.equal(got.response_ids, expected.sequences[:, input_ids.shape[1]:])
    sequences = expected.sequences
    full_mask = torch.cat([attention_mask, torch.ones_like(got.response_ids)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full_mask,
                       position_ids=position_ids_from_mask(full_mask)).logits
    width = input_ids.shape[1]
    scaled = logits[:, width - 1 : -1].float() / 0.7
    kept = torch.stack([torch.stack([fake_vllm.truncated(position, 50, 0.95) for position in row]) for row in scaled])
    fresh = gather_logprobs(kept, got.response_ids)
    torch.testing.assert_close(got.logprobs, fresh, rtol=1e-5, atol=1e-5)
    assert bool((fresh - gather_logprobs(scaled, got.response_ids)).ge(0).all())  # q ≥ the policy where it keeps


def test_the_embedded_model_under_bf16_autocast_draws_what_generate_draws(compose) -> None:
    """Mixed precision, full fine-tuning: ``generate`` (every product through its weight cast once and, where
    oneDNN has bfloat16 kernels, packed once) against ``model.generate`` under the same autocast (autocast's
    cached casts): the same tokens, the logits bit for bit."""
    model_cfg = compose(["model=smollm2_135m"]).model
    tokenizer = models.load_tokenizer(model_cfg)
    model = models.load_causal_lm(model_cfg, tokenizer, "float32", 0).eval()
    input_ids, attention_mask = encoded_prompts(tokenizer, group_size=2)
    formatted = format_prompts(PROMPTS, tokenizer, True, None)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast, generation_weights(model, rows=input_ids.shape[0]) as patched:
        packs = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert patched == (sum(isinstance(m, torch.nn.Linear) for m in model.modules()) if packs else 0)
    torch.manual_seed(5)
    with torch.no_grad(), autocast:
        expected = plain_generate(model, input_ids, attention_mask, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                  temperature=1.0, top_k=0, top_p=1.0)
    torch.manual_seed(5)
    with autocast:
        got = generate(model, tokenizer, formatted, 2, MAX_NEW_TOKENS, 1.0, 1.0, 0, 256, keep_logits=True,
                       share_prompts=False)
    width = input_ids.shape[1]
    assert torch.equal(got.response_ids, expected.sequences[:, width:])
    steps = got.response_ids.shape[1]
    assert torch.equal(got.policy_logits, torch.stack(expected.logits, dim=1)[:, :steps].float())
