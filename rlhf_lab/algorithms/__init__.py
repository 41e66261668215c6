"""Algorithms: an advantage estimator and a loss over a rollout, registered under kind ``algorithm``."""
