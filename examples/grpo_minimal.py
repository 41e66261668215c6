"""GRPO with the k3 KL estimator in the loss, top to bottom, from rlhf_lab's public pieces.

    python examples/grpo_minimal.py                       # the tiny random Llama, about 20 s on a laptop CPU
    python examples/grpo_minimal.py --model smollm2_135m  # the embedded SmolLM2-135M-Instruct (slower)

One step (Shao et al. 2024, "DeepSeekMath"; the KL as Schulman's k3, placed in the loss):
  1. sample G responses per prompt from π_θ (among its top-k tokens);
  2. score each response: R_i;
  3. group-relative advantages A_i = (R_i − mean_group R) / (std_group R + ε), the same for every token of i;
  4. reference log-probs log π_ref(y_t) (the frozen initial model);
  5. loss = token-mean of  max(−A·r_t, −A·clip(r_t, 1−ε, 1+ε))  +  β · token-mean of k3_t,
     r_t = π_θ(y_t)/π_old(y_t),   k3_t = π_ref/π_θ − 1 − log(π_ref/π_θ);  with one update per batch π_old is
     π_θ itself, detached (the sampler's log-probs are of the top-k truncation it drew from, not of π_θ);
  6. one AdamW step.
The toy reward is the share of response tokens from the lower half of the vocabulary. Sampling among the 16
likeliest tokens (top-k), a random model starts near 0.5 and GRPO takes it near 1 in about six steps, while the k3
term measures how far it has moved from the reference. The trainer (``rlhf-lab``) runs the same pieces with more
around them: batching over ranks, micro-batches, evaluation, checkpoints, logging.
"""

from __future__ import annotations

import argparse
import copy
from types import SimpleNamespace

import torch

import rlhf_lab.components  # noqa: F401  (registers the built-in parts)
from rlhf_lab.algorithms.losses import ClipRange
from rlhf_lab.generation.hf import generate
from rlhf_lab.masked import masked_mean, masked_sum
from rlhf_lab.models.loading import build_tiny_llama, load_causal_lm, load_tokenizer
from rlhf_lab.registry import get
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs

PROMPTS = ["Write a line about the sea.", "Describe a film you liked.", "Say something kind.", "Name a colour."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2_135m"], default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=0.04, help="β")
    parser.add_argument("--top-k", type=int, default=16, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_models(name: str, seed: int) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(policy π_θ, frozen reference π_ref, tokenizer)."""
    model_cfg = SimpleNamespace(name=name, name_or_path=None)
    tokenizer = load_tokenizer(model_cfg)
    if name == "tiny":
        dims = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2)
        policy = build_tiny_llama(tokenizer, dims, seed=seed)
    else:
        policy = load_causal_lm(model_cfg, tokenizer, "float32", seed)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, reference, tokenizer


def reward(response_ids: torch.Tensor, response_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """R_i: the share of response i's tokens whose id is in the lower half of the vocabulary, [B]."""
    return masked_mean((response_ids < vocab_size // 2).float(), response_mask, dim=-1)


def train(args: argparse.Namespace) -> list[dict[str, float]]:
    torch.manual_seed(args.seed)
    policy, reference, tokenizer = build_models(args.model, args.seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    advantage_estimator = get("advantage", "grpo")  # (R − mean_group) / (std_group + 1e-4) on every token
    policy_loss = get("policy_loss", "clip")  # PPO's clipped surrogate, per token
    k3 = get("kl", "k3")  # the KL estimator: estimator(logprobs, ref_logprobs) -> [B, T]
    clip = ClipRange(args.clip_eps, args.clip_eps)
    history = []
    for step in range(args.steps):
        # 1. sample: G responses per prompt.
        with torch.no_grad():
            rollout = generate(policy, tokenizer, PROMPTS, args.group_size, args.max_new_tokens, temperature=1.0,
                               top_p=1.0, top_k=args.top_k, max_prompt_tokens=128, keep_logits=False)
        mask = rollout.response_mask  # [B, T]: 1 on response tokens up to and including the first EOS
        # 2. score; 3. group-relative advantages (the score sits on the last token, so its sum is R_i).
        scores = reward(rollout.response_ids, mask, len(tokenizer))
        token_rewards = torch.zeros_like(mask).scatter(1, (mask.sum(-1).long() - 1)[:, None], scores[:, None])
        advantages = advantage_estimator(token_rewards, mask, args.group_size, SimpleNamespace(scale_by_std=True))
        # 4. the reference's log-probs of the sampled tokens.
        with torch.no_grad():
            ref_logits, _ = response_logits(reference, rollout.input_ids, rollout.attention_mask,
                                            rollout.prompt_width, temperature=1.0)
            ref_logprobs = gather_logprobs(ref_logits, rollout.response_ids)
        # 5. the policy's log-probs with gradient, the clipped surrogate and the k3 term, token means.
        logits, _ = response_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width, 1.0)
        logprobs = gather_logprobs(logits, rollout.response_ids)
        surrogate = policy_loss(logprobs, logprobs.detach(), advantages, mask, clip)  # π_old: this pass, detached
        tokens = mask.sum()
        pg_loss = masked_sum(surrogate.per_token, mask) / tokens
        kl = k3(logprobs, ref_logprobs)
        kl_loss = masked_sum(kl, mask) / tokens
        loss = pg_loss + args.kl_coef * kl_loss
        # 6. one optimizer step.
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history.append({"step": step, "reward/mean": scores.mean().item(), "kl/estimate": kl_loss.item(),
                        "loss/policy": pg_loss.item(), "loss/total": loss.item()})
        print(" ".join(f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in history[-1].items()))
    return history


if __name__ == "__main__":
    train(parse_args())
