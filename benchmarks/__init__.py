"""rlhf_lab's benchmarks, kept in the repository and out of the wheel: no training run imports them.

- :mod:`benchmarks.bench`: training steps timed per phase, optionally against TRL's ``GRPOTrainer`` on identical
  settings (``make bench``, ``python -m benchmarks.bench``; ``rlhf-lab bench`` from a checkout runs the same).
- :mod:`benchmarks.scale_bench`: processes, precision and memory savers, each a real ``rlhf-lab`` process
  (``python -m benchmarks.scale_bench``).

Run them from the repository's top folder; docs/benchmarks.md says what each figure means.
"""
