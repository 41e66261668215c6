"""Choice lists that no other module owns yet; each is listed here once and nowhere else (and the one line a
missing ``generation.sync_folder`` gets, which the config check and the server engine both give).

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
LOGPROB_SOURCES = ("auto", "trainer", "sampler")  # generation.logprobs (rlhf_lab/step/scoring_pass.py)
WEIGHT_SYNC = ("folder", "collective")  # generation.weight_sync (vllm_server): how the weights reach the server
SIMULATES_STALENESS = ("hf", "vllm")  # generation.simulate_staleness: the engines colocated with the trainer
MAX_STALENESS = 16  # generation.max_staleness: updates between the weights that sample a batch and those it trains
EXACT_KL = ("step", "eval", "off")  # kl.exact: when the exact KL from full logits is computed


def sync_folder_needed(lora: bool) -> str:
    """The one line for a server engine without the folder its weights would go through."""
    what = "a LoRA adapter goes" if lora else "the policy's weights go"
    return (f"generation=vllm_server needs generation.sync_folder: a folder the trainer and the server both read "
            f"({what} through it after every update){'' if lora else ', or generation.weight_sync=collective'}")
