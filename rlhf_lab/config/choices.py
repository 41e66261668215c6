"""Choice lists that no other module owns yet; each is listed here once and nowhere else.

The other choice fields take their values from where the concept lives: registered names
(``rlhf_lab.registry.names``: algorithm, kl, kl_placement, kl_controller, reward, logger,
loss_aggregation, baseline) or a constant next to the code (``rlhf_lab.algorithms.base.WEIGHT_SOURCES``,
``rlhf_lab.algorithms.ppo.CRITICS``, ``rlhf_lab.trackers.wandb_run.MODES``,
``rlhf_lab.rewards.sentiment.TARGETS``, ``rlhf_lab.rewards.classifier.OUTPUTS``).
"""

from __future__ import annotations

LR_SCHEDULES = ("constant", "linear", "cosine")  # trainer.lr_schedule (after warmup)
DEVICES = ("auto", "cpu", "cuda", "mps")  # trainer.device, besides cuda:N
ON_NONFINITE = ("error", "drop")  # reward.on_nonfinite: a NaN/inf score stops the run or drops that sample
LOGPROB_SOURCES = ("auto", "trainer", "sampler")  # generation.logprobs (rlhf_lab/training/scoring_pass.py)
EXACT_KL = ("step", "eval", "off")  # kl.exact: when the exact KL from full logits is computed
