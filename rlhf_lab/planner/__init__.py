"""Predicting a step before launch: its memory by phase and its FLOPs, from the step's own code run on fake
tensors (:mod:`.step`), read for a device (:mod:`.report`). ``rlhf-lab plan`` prints it (rlhf_lab/tools/plan.py)."""
