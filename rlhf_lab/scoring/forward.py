"""Scoring passes: the logits a model gives each response token of a batch, with or without gradient.

The same function serves the reference pass (no gradient), the training pass (with gradient) and, through
:func:`prefill_shared`, the decode loop's prompt prefill. Rows that share a prompt (the G samples of a group)
run that prompt through the network once; its key/value cache is indexed out to every row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.runtime import distributed
from rlhf_lab.scoring.head import HeadLogits
from rlhf_lab.scoring.logprobs import scale_logits
from rlhf_lab.scoring.packing import pack_rows


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as generation uses them: cumsum(mask) − 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

def prefill_shared(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                   rows: Tensor, **kwargs: Any) -> Any:
    """Run each distinct prompt through ``model`` once and expand its key/value cache to ``rows``.

    ``rows[i]`` is the prompt that batch row ``i`` continues from. The returned output's logits (last
    position only) and hidden states are per prompt; its ``past_key_values`` are per row, ready for the
    continuation (generation, or the response tokens of a scoring pass). Indexing keeps the gradient path.
    """
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=True, logits_to_keep=1, **kwargs)
    output.past_key_values.batch_select_indices(rows)
    return output

def cache_off(model: nn.Module) -> bool:
    """Whether ``model``'s forward returns no key/value cache: transformers turns it off under its activation
    checkpointing (``trainer.gradient_checkpointing``) in a layer in training mode (the training pass sets the
    layers' flags: :func:`~rlhf_lab.models.recompute.layers_checkpointing`), where the layers recompute."""
    return any(getattr(module, "gradient_checkpointing", False) is True and module.training
               for module in model.modules())


def agreed(model: nn.Module, local: bool) -> bool:
    """``local``, where every rank agrees on it under sharded weights (FSDP: each forward pass is a collective,
    so every rank must take the same passes); else ``local``."""
    if any(map(distributed.sharded, model.parameters())):
        return distributed.all_reduce_flags(local)
    return local


def head_parts(head: nn.Module | None) -> tuple[nn.Linear, tuple[Tensor, Tensor, float] | None] | None:
    """(the linear layer of an LM head, a LoRA adapter's (A, B, scale) where one adds to it now) for a plain
    ``nn.Linear`` or peft's LoRA-wrapped one (``model.lora.target_modules`` naming the head); None for any other
    head, and for a LoRA head HeadLogits cannot reproduce: several active adapters, a LoRA variant (DoRA), a bias
    on B, or dropout while training (each chunk's recomputation would draw its mask again)."""
    if type(head) is nn.Linear:
        return head, None
    base = getattr(head, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(head, "lora_A"):
        return None
    if head.merged or head.disable_adapters:  # merged into the base weight, or the reference's pass: the base alone
        return base, None
    active = [name for name in head.active_adapters if name in head.lora_A]
    if not active:
        return base, None
    name = active[0]
    dropout = head.lora_dropout[name]
    if (len(active) > 1 or name in head.lora_variant or head.lora_B[name].bias is not None
            or (head.training and isinstance(dropout, nn.Dropout) and dropout.p > 0)):
        return None
    return base, (head.lora_A[name].weight, head.lora_B[name].weight, float(head.scaling[name]))


def plain_head(model: nn.Module) -> nn.Module | None:
    """``model``'s LM head where :class:`~rlhf_lab.scoring.head.HeadLogits` can stand for its output: a plain
    ``nn.Linear`` or a LoRA-wrapped one (:func:`head_parts`), no soft-capping after it, and transformers' own
    ``forward`` (a subclass's may change the logits after the head); else None.

    Under FSDP2 (:func:`~rlhf_lab.runtime.distributed.shard`) the head is one of the root's parameters, which the
    root keeps gathered from its forward to the end of its backward (FSDP2 does not reshard the root after its
    forward): a pass with gradient reads the gathered weight there, and its gradient reaches FSDP's reduce-scatter as
    the whole logits' would (tests/unit/test_fsdp_head.py). A head that is an FSDP unit of its own (resharded after
    its forward) is not taken."""
    from torch.distributed.fsdp import FSDPModule

    inner = distributed.unwrap(model)
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    config = getattr(inner, "config", None)
    if head_parts(head) is None:
        return None
    units = [module for module in inner.modules() if isinstance(module, FSDPModule) and module is not inner]
    if isinstance(inner, FSDPModule):
        if any(head in unit.modules() for unit in units):
            return None  # in an FSDP unit below the root: resharded after its own forward
    elif units or distributed.sharded(head.weight):
        return None
    if getattr(config, "final_logit_softcapping", None) is not None:
        return None
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # under a LoRA wrapper, its model
    if not type(base).forward.__module__.startswith("transformers."):
        return None  # a forward of its own may change the logits after the head (the exact task masks tokens)
    return head


def gathered_by_fsdp(model: nn.Module) -> bool:
    """Whether ``model``'s weights are FSDP2's, gathered for a pass and freed (or overwritten) at its next reshard."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(distributed.unwrap(model), FSDPModule)


@contextmanager
def head_skipped(head: nn.Linear, copy: bool = False) -> Iterator[None]:
    """Within the block ``head`` hands its input on unchanged: the model's "logits" are the hidden states the
    head reads (an instance ``forward``, removed after the block). ``copy``: a copy of them (an FSDP2 root must not
    return a view of its activations)."""
    head.forward = (lambda hidden: hidden.clone()) if copy else (lambda hidden: hidden)
    try:
        yield
    finally:
        del head.forward


def head_logits(head: nn.Module, hidden: Tensor, temperature: float, chunk: int, detach: bool,
                copy: bool = False) -> HeadLogits:
    """The :class:`HeadLogits` of ``hidden`` through ``head``, under the autocast now active (the model's).

    ``detach``: a pass without gradient keeps the weight as it is now (a reference moved off the device after
    its pass keeps these on it). ``copy`` (with ``detach``): a copy of it, for FSDP2's gathered weight, which its
    next reshard frees: one [V, H] weight in place of the pass's [B, T, V] logits."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    linear, lora = head_parts(head)  # the adapter as it is now: disabled in the reference's pass
    weight, bias = linear.weight, linear.bias
    if distributed.sharded(weight):
        raise RuntimeError("the LM head's weight is sharded after its forward: FSDP resharded it, so the chunked "
                           "LM head cannot read it (set trainer.chunked_logprobs=false)")
    logits = HeadLogits(hidden, weight, bias, temperature, chunk, dtype, lora)
    if detach:
        logits = logits.detach()
        if copy:
            logits = replace(logits, weight=logits.weight.clone(), bias=None if bias is None else logits.bias.clone(),
                             lora=None if lora is None else (lora[0].clone(), lora[1].clone(), lora[2]))
    return logits


def response_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                    temperature: float, output_hidden_states: bool = False,
                    share_prompts: bool = True, float32: bool = True,
                    head_chunk: int = 0, pack: bool = False) -> tuple[Tensor | HeadLogits, Tensor | None]:
    """Temperature-scaled logits predicting each response token: [B, T, V] (and last hidden states [B, T, H]).

    With ``head_chunk`` > 0 (``trainer.chunked_logprobs``) and a plain LM head (:func:`plain_head`), the logits
    are a :class:`~rlhf_lab.scoring.head.HeadLogits`: the head's inputs, never made whole; the log-probs, the
    entropy and the exact KL are then computed from them ``head_chunk`` positions at a time.

    In float32, or with ``float32=False`` at temperature 1 in the LM head's own dtype (bfloat16 under autocast:
    the same numbers, without the [B, T, V] float32 copy, for a caller that upcasts them in chunks itself).

    Only the positions that predict response tokens go through the LM head (``logits_to_keep``). With
    ``share_prompts``, rows that share a prompt (the G samples of a group) run that prompt through the
    network once; its key/value cache is then indexed out to every row, and gradients flow back through
    it. The result equals the plain forward pass (see :func:`_plain_response_logits`) to float precision.

    With ``pack`` the rows run padding-free as one packed sequence (:mod:`rlhf_lab.scoring.packing`; no prompt
    sharing then), their outputs gathered back into the same [B, T, …] layout.
    """
    head = plain_head(model) if head_chunk > 0 else None
    if head is not None:
        fsdp = gathered_by_fsdp(model)
        with head_skipped(head, copy=fsdp):
            hidden_in, hidden = response_logits(model, input_ids, attention_mask, prompt_width, 1.0,
                                                output_hidden_states, share_prompts, float32=False, pack=pack)
        return head_logits(head, hidden_in, temperature, head_chunk, not torch.is_grad_enabled(), fsdp), hidden
    packed = pack_rows(input_ids, attention_mask, prompt_width) if pack else None
    if packed is not None:
        output = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                       use_cache=False, logits_to_keep=packed.keep, output_hidden_states=output_hidden_states)
        logits = scale_logits(packed.unpack(output.logits), temperature, float32)
        hidden = packed.unpack(output.hidden_states[-1][:, packed.keep]) if output_hidden_states else None
        return logits, hidden
    prompt_ids = input_ids[:, :prompt_width]
    unique_prompts, row_to_prompt = torch.unique(prompt_ids, dim=0, return_inverse=True)
    # (a response part of one token leaves nothing to continue with: the plain pass)
    shared = share_prompts and unique_prompts.shape[0] < input_ids.shape[0] and input_ids.shape[1] > prompt_width + 1
    shared = shared and not cache_off(model)  # the shared prefill hands its cache on to the rows
    if not agreed(model, shared):
        return _plain_response_logits(model, input_ids, attention_mask, prompt_width, temperature,
                                      output_hidden_states, float32)
    # One representative row per unique prompt.
    first_row = torch.full((unique_prompts.shape[0],), input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    first_row.scatter_reduce_(0, row_to_prompt, torch.arange(input_ids.shape[0], device=input_ids.device), "amin")
    positions = position_ids_from_mask(attention_mask)
    prefix = prefill_shared(model, prompt_ids[first_row], attention_mask[first_row, :prompt_width],
                            positions[first_row, :prompt_width], row_to_prompt,
                            output_hidden_states=output_hidden_states)
    cache = prefix.past_key_values
    first_logits = prefix.logits[:, -1:].index_select(0, row_to_prompt)
    # The last response token predicts nothing, so the continuation stops one short of the end.
    continuation = model(
        input_ids=input_ids[:, prompt_width:-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=positions[:, prompt_width:-1],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )
    logits = scale_logits(torch.cat([first_logits, continuation.logits], dim=1), temperature, float32)
    hidden = None
    if output_hidden_states:
        first_hidden = prefix.hidden_states[-1][:, -1:].index_select(0, row_to_prompt)
        hidden = torch.cat([first_hidden, continuation.hidden_states[-1]], dim=1)
    return logits, hidden

def _plain_response_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                           temperature: float, output_hidden_states: bool = False,
                           float32: bool = True) -> tuple[Tensor, Tensor | None]:
    """One forward pass over every row's prompt and response (the reference computation)."""
    response_width = input_ids.shape[1] - prompt_width
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_width + 1,
        output_hidden_states=output_hidden_states,
        use_cache=False,
    )
    logits = scale_logits(output.logits[:, :-1], temperature, float32)
    hidden = output.hidden_states[-1][:, prompt_width - 1 : -1] if output_hidden_states else None
    return logits, hidden
