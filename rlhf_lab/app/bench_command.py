"""``rlhf-lab bench``: the benchmarks live in the repository (``benchmarks/``), outside the wheel.

From a checkout (an editable install, or the sources on ``PYTHONPATH``) the command runs :mod:`benchmarks.bench`,
as ``python -m benchmarks.bench`` and ``make bench`` do. A package installed without the repository has no
benchmarks to run: the command says where they are, in one line (exit status 2).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]  # the checkout holding rlhf_lab/, when there is one
NOT_SHIPPED = ("rlhf-lab bench runs from a repository checkout (benchmarks/ is not in the installed package): "
               "clone the rlhf_lab repository, then run `make bench` or `python -m benchmarks.bench` in it")


def main(args: list[str]) -> None:
    """Run :func:`benchmarks.bench.main` with ``args`` from this checkout, or exit 2 naming what to run instead."""
    if not (REPOSITORY / "benchmarks" / "bench.py").is_file():
        print(f"error: {NOT_SHIPPED}", file=sys.stderr)
        sys.exit(2)
    if str(REPOSITORY) not in sys.path:
        sys.path.insert(0, str(REPOSITORY))  # the console script's path lacks the checkout; `python -m` has its cwd
    importlib.import_module("benchmarks.bench").main(args)
