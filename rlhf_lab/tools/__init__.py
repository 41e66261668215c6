"""Tools beside the training path: ``report``, ``export``, ``eval``, ``pipeline``, ``serve``, ``wandb``, ``plan``
(the benchmarks are outside the package, in the repository's ``benchmarks/``)."""
