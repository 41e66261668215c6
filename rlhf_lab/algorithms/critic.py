"""PPO's critic: a scalar value V(s_t) for every response token.

The state before response token t is the prefix that predicts it, so V_t is read from the last hidden
state at the position whose logits give token t (the same positions ``response_logits`` keeps).

- ``critic: shared``: a :class:`ValueHead` on the policy's own trunk (TRL's ``...WithValueHead``). The
  value loss reaches the trunk too, so with LoRA it trains the policy's adapter alongside the head.
- ``critic: separate``: a :class:`SeparateCritic`, its own copy of the policy's trunk plus a value head.
  Full fine-tuning copies the whole trunk (a third network in memory, trained alongside the policy).
  With a LoRA policy the critic *shares* the frozen base weights (no second copy, as the reference model
  does) and trains its own copy of the LoRA adapter: the copy is made in ``setup`` before any update, when
  the adapter is still at its initialisation (B = 0), so it starts as a fresh adapter of the same rank and
  targets. Only the critic's trainable tensors are checkpointed (the shared base weights are not).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.scoring.forward import position_ids_from_mask
from rlhf_lab.scoring.packing import pack_rows, packing


class ValueHead(nn.Module):
    """V = w·h + b on each last hidden state: [B, T, H] -> [B, T], float32 whatever the trunk's dtype.

    Initialised to zero (a single output has no symmetry to break): the first values are 0, so the first
    advantages are plain discounted returns, and the head cannot inject noise before it has learned.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):  # float32 under a mixed precision too
            return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


def policy_trunk(policy: nn.Module) -> nn.Module:
    """The transformer body (no LM head) of a causal LM, looking through a peft wrapper."""
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    return model.get_decoder()


def hidden_size_of(policy: nn.Module) -> int:
    return int(policy.config.hidden_size)


class SeparateCritic(nn.Module):
    """Its own trunk (a copy of the policy's, frozen weights shared) and a :class:`ValueHead`."""

    def __init__(self, trunk: nn.Module, hidden_size: int) -> None:
        super().__init__()
        # deepcopy with the frozen tensors pre-filled in the memo: they are shared, the rest is copied.
        frozen = {id(p): p for p in trunk.parameters() if not p.requires_grad}
        self.trunk = copy.deepcopy(trunk, frozen)
        self.value_head = ValueHead(hidden_size)
        self.frozen_names = {n for n, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Tensor:
        """Values of the response tokens of ``[prompt (width P) | response]`` rows: [B, P+T] -> [B, T]."""
        packed = pack_rows(input_ids, attention_mask, prompt_width) if packing() else None
        if packed is not None:  # padding-free (trainer.pack_rows): the same values at every response token
            output = self.trunk(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                                use_cache=False)
            return self.value_head(packed.unpack(output.last_hidden_state[:, packed.keep]))
        output = self.trunk(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return self.value_head(output.last_hidden_state[:, prompt_width - 1 : -1])

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """Trainable tensors only: frozen base weights shared with the policy are not the critic's to save."""
        state = super().state_dict(*args, **kwargs)
        return {name: value for name, value in state.items() if name not in self.frozen_names}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [name for name in result.missing_keys if name not in self.frozen_names]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"critic state does not match: missing {missing}, unexpected {result.unexpected_keys}")
        return result
