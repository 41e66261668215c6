"""``kl.off_policy_correction`` through the real trainer (rlhf_lab/kl/corrections.py): on the exact task, k3 in the
loss weighted by its own ratio trains, and on-policy (one update per rollout) the ratio is 1, so the loss term's
value equals the plain one's step by step, while the gradient differs (k3's forward-KL gradient against the reverse
KL's, OFF_POLICY_KL_GRADIENT)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlhf_lab.training.loop import Trainer

TASK = ["experiment=exact", "model.exact.symbols=3", "trainer.max_new_tokens=2", "reward.peaks=2", "kl=k3",
        "kl.placement=loss", "kl.coef=0.2", "algorithm=rloo", "trainer.steps=3", "trainer.exact_every=1",
        "logger.samples_every=1000", "seed=1"]


def run(compose, folder: Path, correction: str) -> list[dict]:
    cfg = compose([*TASK, f"kl.off_policy_correction={correction}", f"trainer.output_dir={folder}"])
    Trainer(cfg, folder).train()
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


def test_the_ratio_weighted_k3_trains_and_moves_differently(compose, tmp_path: Path) -> None:
    plain, ratio, prefix = (run(compose, tmp_path / name, name) for name in ("policy", "token_ratio", "prefix_ratio"))
    assert len(plain) == len(ratio) == len(prefix) == 3
    assert all(math.isfinite(line["loss/total"]) for line in ratio + prefix)
    assert plain[0]["loss/total"] == ratio[0]["loss/total"]  # same samples, weight 1 on-policy: same value
    assert plain[-1]["exact/kl_sequence"] != ratio[-1]["exact/kl_sequence"]  # another gradient, another policy
