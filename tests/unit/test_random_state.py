"""Every generator of the process kept around a block that reseeds them (an in-process vLLM engine's start)."""

from __future__ import annotations

import random

import numpy as np
import torch

from rlhf_lab.runtime import random_state


def draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_a_block_that_reseeds_every_generator_leaves_their_streams_where_they_were() -> None:
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = draws()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    with random_state.kept():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        draws()
    assert draws() == expected
