"""Scoring passes: the logits a model gives each response token (:mod:`.forward`) and log-probs/entropies from them (:mod:`.logprobs`)."""
