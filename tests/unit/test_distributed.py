"""distributed: strategy resolution, sharding helpers, and reductions that are exact identities in one process."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab import masked
from rlhf_lab.errors import ConfigError
from rlhf_lab.runtime import distributed
from rlhf_lab.step.ahead import rng_key
from rlhf_lab.training.evaluation import shard


def test_single_process_is_rank_zero_of_one(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (distributed.rank(), distributed.world_size(), distributed.is_main_process()) == (0, 1, True)
    assert distributed.launched_processes() == 1
    assert distributed.mean_across_ranks({"a": 1.0}) == {"a": 1.0}


@pytest.mark.parametrize(("strategy", "processes", "expected"), [
    ("auto", 1, "single"), ("auto", 2, "ddp"), ("fsdp", 1, "fsdp"), ("fsdp", 4, "fsdp"), ("ddp", 2, "ddp"),
    ("single", 1, "single"),
])
def test_strategy_follows_the_launch(strategy: str, processes: int, expected: str) -> None:
    assert distributed.resolve_strategy(strategy, processes) == expected


def test_strategies_that_do_not_fit_the_launch_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"^trainer.strategy=ddp needs a multi-process launch \(WORLD_SIZE=1\); "
                                          r"launch with torchrun"):
        distributed.resolve_strategy("ddp", 1)
    with pytest.raises(ConfigError, match=r"^trainer.strategy=single, but launched as 2 processes"):
        distributed.resolve_strategy("single", 2)
    with pytest.raises(ConfigError, match=r"^trainer.strategy='zero3' is not valid; choose from: auto, single, "):
        distributed.resolve_strategy("zero3", 1)


def test_reductions_are_the_local_expressions_in_one_process() -> None:
    values = torch.tensor([[1.0, 2.0, 7.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for reduce in (masked.masked_mean, masked.masked_var, masked.masked_whiten):
        assert torch.equal(reduce(values, mask, across_ranks=True), reduce(values, mask))
    assert torch.equal(distributed.mean(values), values.mean())
    assert distributed.gather_rows(values) is values
    assert distributed.gather_objects(["a"]) == ["a"]
    assert distributed.sum_dict({"x": 1.5}) == {"x": 1.5}
    assert distributed.all_reduce_flags(True) and not distributed.all_reduce_flags(False)


def test_shard_gives_contiguous_blocks_covering_every_index_once() -> None:
    assert [shard(5, r, 2) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [shard(2, r, 4) for r in range(4)] == [[0], [1], [], []]
    assert sum((shard(16, r, 3) for r in range(3)), []) == list(range(16))


def test_rng_keys_differ_by_split_step_and_position_and_fit_a_generator_seed() -> None:
    keys = {rng_key(0, split, step, position) for split in (0, 1) for step in range(3) for position in range(4)}
    assert len(keys) == 24
    assert all(0 <= key < 2**62 for key in keys)
    assert rng_key(1, 0, 0, 0) != rng_key(0, 0, 0, 0)


def test_sharded_tells_a_tensor_subclass_from_plain_tensors_and_parameters() -> None:
    class Shard(torch.Tensor):  # stands for FSDP2's DTensor: any subclass holding the values
        pass

    plain = torch.zeros(2, 3)
    assert not distributed.sharded(plain) and not distributed.sharded(torch.nn.Parameter(plain))
    assert distributed.sharded(plain.as_subclass(Shard))


class Reached(Exception):
    """Raised by the fake collectives once they have seen their tensors."""


def test_every_reduction_hands_its_collective_tensors_on_the_collective_device(monkeypatch) -> None:
    """NCCL takes only tensors on the process's GPU: every reduction moves its tensors to ``collective_device()``
    before the collective (here a stand-in device, ``meta``, that no input lives on)."""
    seen: list[set[str]] = []

    def collective(first, *args, **kwargs):
        tensors = [*(first if isinstance(first, list) else [first]), *(a for a in args if isinstance(a, torch.Tensor))]
        seen.append({tensor.device.type for tensor in tensors})
        raise Reached

    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "collective_device", lambda: torch.device("meta"))
    monkeypatch.setattr(distributed.dist, "all_reduce", collective)
    monkeypatch.setattr(distributed.dist, "all_gather", collective)
    values, mask = torch.ones(2, 3), torch.ones(2, 3)
    calls = [
        lambda: distributed.all_reduce_sum(values), lambda: distributed.all_reduce_flags(True),
        lambda: distributed.any_rank(False), lambda: distributed.sum_dict({"loss": 1.0}),
        lambda: distributed.gather_rows(values), lambda: distributed.mean(values),
        lambda: distributed.maximum(torch.tensor(2.0)), lambda: distributed.minimum(torch.tensor(2.0)),
        lambda: distributed.mean_across_ranks({"reward": 1.0}),
        lambda: masked.masked_mean(values, mask, across_ranks=True),
        lambda: masked.masked_var(values, mask, across_ranks=True),
        lambda: masked.masked_whiten(values, mask, across_ranks=True),
    ]
    for call in calls:
        with pytest.raises(Reached):
            call()
    assert seen == [{"meta"}] * len(calls)


def test_the_package_calls_collectives_only_through_the_distributed_helpers() -> None:
    import re
    from pathlib import Path

    import rlhf_lab

    root = Path(rlhf_lab.__file__).parent
    direct = re.compile(r"\bdist\.(all_reduce|all_gather|all_gather_into_tensor|reduce_scatter|broadcast|reduce|gather|"
                        r"scatter|all_to_all)\(")
    offenders = [str(path.relative_to(root)) for path in root.rglob("*.py")
                 if path.name != "distributed.py" and direct.search(path.read_text())]
    assert offenders == []


def test_fsdp_modules_reduce_their_gradients_once_per_mini_batch() -> None:
    """Under FSDP2 a skipped micro-batch turns the reduce-scatter off for its backward and on again after."""
    from rlhf_lab.runtime.distributed import no_sync

    class Sharded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[bool] = []

        def set_requires_gradient_sync(self, requires: bool) -> None:
            self.calls.append(requires)

    module = Sharded()
    with no_sync([module], skip=True):
        assert module.calls == [False]
    assert module.calls == [False, True]
    with no_sync([module], skip=False):
        pass
    assert module.calls == [False, True]
