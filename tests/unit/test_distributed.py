"""distributed: one process today; a multi-process launch stops at start with one line."""

from __future__ import annotations

import pytest

from rlhf_lab import distributed
from rlhf_lab.errors import ConfigError


def test_single_process_is_rank_zero_of_one(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (distributed.rank(), distributed.world_size(), distributed.is_main_process()) == (0, 1, True)
    assert distributed.launched_processes() == 1
    distributed.refuse_multi_process()  # no error
    assert distributed.mean_across_ranks({"a": 1.0}) == {"a": 1.0}


def test_a_torchrun_launch_is_refused_with_one_line(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as raised:
        distributed.refuse_multi_process()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("launched as 2 processes (WORLD_SIZE=2), but rlhf_lab trains in one process only")
    assert "torchrun" in message
