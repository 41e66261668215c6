"""``hydra/sweeper=optuna``: a thin Hydra sweeper around current Optuna (TPE by default), shipped with rlhf_lab.

hydra-optuna-sweeper 1.3.0 pins ``optuna<3``; Optuna 2.10.1 cannot open a SQLite study next to SQLAlchemy 2
(its storage fails at start), so the engine here is a maintained Optuna release and this package only maps Hydra
to it: the search space in Hydra's override grammar, one trial per Hydra job, jobs launched in batches of
``n_jobs`` through whichever launcher is configured. Its config keys are hydra-optuna-sweeper's, so its
``hparams_search`` files work unchanged. Hydra imports every module of the ``hydra_plugins`` namespace at start:
this one imports Optuna only when a sweep runs (see :mod:`._search`).
"""
