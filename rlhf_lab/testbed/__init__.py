"""The exact task: a small-vocabulary language-model task whose regularised optimum is known in closed form.

``model=exact data=exact reward=exact_table`` (or ``experiment=exact``) trains a real ``LlamaForCausalLM`` over a
tokenizer of V symbols, with responses of exactly T = ``trainer.max_new_tokens`` symbols after a one-token
prompt, through the same trainer, algorithms, KL estimators, placements, LoRA, checkpoints and trackers as a
language model. The reference is the initial policy; the reward is a seeded table over all V^T responses.
Because every response can be enumerated, J(π) = E_π[R] − β·KL(π‖π_ref) and its maximiser
π* ∝ π_ref·exp(R/β) are computed exactly, and every step logs how far the policy is from π* (``exact/*``).

- :mod:`~rlhf_lab.testbed.task`: tokenizer, model, reward table, enumeration of responses;
- :mod:`~rlhf_lab.testbed.metrics`: the optimum, the exact metrics, and the trainer's hook.
"""
