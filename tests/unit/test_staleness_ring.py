"""The snapshot ring of ``generation.simulate_staleness`` (rlhf_lab/generation/staleness.py): what it keeps, the past
weights in a block and the current ones back bit for bit, its checkpoint form, and a checkpoint without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhf_lab.errors import CheckpointError
from rlhf_lab.generation.staleness import SnapshotRing


def small_policy() -> nn.Module:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    policy[1].weight.requires_grad_(False)  # frozen: an update never changes it, the ring never keeps it
    return policy


def values(policy: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.named_parameters()}


@torch.no_grad()
def step(policy: nn.Module, amount: float) -> None:
    """A stand-in update: every trainable weight moves by ``amount``."""
    for p in policy.parameters():
        if p.requires_grad:
            p.add_(amount)


def test_a_block_holds_the_past_weights_and_the_current_ones_come_back_bit_for_bit() -> None:
    policy = small_policy()
    ring = SnapshotRing(policy, staleness=2)
    assert ring.behind(0) == 0 and ring.behind(1) == 0 and ring.behind(5) == 3
    versions = []
    for updates in range(3):
        ring.remember(updates)
        versions.append(values(policy))
        step(policy, 0.1 * (updates + 1))
    now = values(policy)  # after 3 updates
    assert set(ring.snapshots) == {0, 1, 2}
    assert set(ring.snapshots[0]) == {"0.weight", "0.bias", "1.bias"}  # not the frozen weight
    with ring.weights_of(1, current=3):
        assert all(torch.equal(p, versions[1][name]) for name, p in policy.named_parameters())
    assert all(torch.equal(p, now[name]) for name, p in policy.named_parameters())
    assert set(ring.snapshots) == {0, 1, 2, 3}  # the current weights were remembered first
    ring.forget_before(2)
    assert set(ring.snapshots) == {2, 3}


def test_the_checkpoint_form_reads_back_and_a_missing_snapshot_is_one_line() -> None:
    policy = small_policy()
    ring = SnapshotRing(policy, staleness=2)
    ring.remember(3)
    step(policy, 1.0)
    ring.remember(4)
    state = ring.state()
    assert set(state) == {f"{v}/{n}" for v in (3, 4) for n in ("0.weight", "0.bias", "1.bias")}
    again = SnapshotRing(policy, staleness=2)
    again.load_state(state, updates=5, where="checkpoints/step_5")  # steps 5 and 6 sample with 3 and 4 updates
    assert all(torch.equal(again.snapshots[v][n], ring.snapshots[v][n]) for v in (3, 4) for n in ring.snapshots[v])
    with pytest.raises(CheckpointError, match=r"^checkpoints/step_6 holds no snapshot of the weights after 4, 5 "
                                              r"update\(s\), which generation.simulate_staleness=true with "
                                              r"generation.max_staleness=2 samples the next steps with"):
        SnapshotRing(policy, staleness=2).load_state({}, updates=6, where="checkpoints/step_6")  # 6 and 7 need 4, 5
    SnapshotRing(policy, staleness=1).load_state({k: v for k, v in state.items() if k.startswith("4/")}, 5, "c")


def test_under_lora_only_the_adapter_is_kept(compose, tiny_overrides, tiny_tokenizer) -> None:
    from rlhf_lab.models.loading import build_policy

    cfg = compose([*tiny_overrides(None), "model.lora.enabled=true", "model.lora.r=4"])
    policy = build_policy(cfg.model, tiny_tokenizer, "float32", 0).policy
    ring = SnapshotRing(policy, staleness=1)
    ring.remember(0)
    kept = ring.snapshots[0]
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert sorted(kept) == sorted(trainable) and kept and all("lora_" in name for name in kept)
    assert sum(t.numel() for t in kept.values()) < sum(p.numel() for p in policy.parameters()) / 10
