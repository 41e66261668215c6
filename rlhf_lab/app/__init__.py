"""Entry points: the `rlhf-lab` command (:mod:`.cli`), the Python API (:mod:`.api`), plug-ins (:mod:`.plugins`)."""
