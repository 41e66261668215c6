"""Policy models (config group ``model``): loading, LoRA, the policy and its reference (:mod:`.loading`); selective recomputation (:mod:`.recompute`)."""
