"""rlhf_lab: Hydra-configured RLHF research (PPO, GRPO, REINFORCE/RLOO; KL estimators; rewards; LoRA)."""

__version__ = "0.1.0"
