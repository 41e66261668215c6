"""The offline half of RLHF: preference and demonstration data, SFT, reward-model training, DPO and variants.

Each stage is an ``algorithm`` option (``sft``, ``reward_model``, ``dpo``) run by the same CLI, config tree,
trackers, checkpoints and evaluation as the online algorithms; rlhf_lab/tools/pipeline.py chains them.
"""
