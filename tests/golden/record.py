"""Record the golden runs: seeded ``model=tiny`` runs whose ``metrics.jsonl`` the golden test compares against.

    python tests/golden/record.py            (writes tests/golden/<name>.jsonl)

Each arm runs 4 steps in-process through :func:`rlhf_lab.training.run` (the same call the CLI makes);
``resume`` runs 2 steps, then resumes the same folder to 4. Re-record only when a change is meant to move
the numbers, and say so in the commit.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")

GOLDEN_DIR = Path(__file__).resolve().parent
BASE = [
    "model=tiny", "trainer.precision=fp32", "trainer.steps=4", "trainer.prompts_per_step=2", "algorithm.group_size=2",
    "trainer.max_new_tokens=4", "trainer.eval_prompts=2", "trainer.eval_every=2", "trainer.progress_bar=false",
    "trainer.num_threads=1", "trainer.lr=1e-3", "seed=3", "reward=length",
]
KL_SETTINGS = {"k3loss": ["kl=k3", "kl.placement=loss"], "k1reward": ["kl=kl", "kl.placement=reward"]}
ALGORITHMS = {
    "grpo": ["algorithm=grpo"],
    "ppo": ["algorithm=ppo", "algorithm.mini_batch_size=2"],
    "reinforce": ["algorithm=reinforce"],
    "rloo": ["algorithm=rloo"],
}
LORA = {"full": [], "lora": ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]}


def arms() -> dict[str, list[str]]:
    """Every golden arm's name and overrides: algorithm × KL setting × LoRA on/off."""
    table = {}
    for algorithm, algorithm_overrides in ALGORITHMS.items():
        for kl_name, kl_overrides in KL_SETTINGS.items():
            for lora_name, lora_overrides in LORA.items():
                table[f"{algorithm}_{kl_name}_{lora_name}"] = [*BASE, *algorithm_overrides, *kl_overrides,
                                                                *lora_overrides]
    return table


RESUME_ARM = [*BASE, "algorithm=ppo", "algorithm.mini_batch_size=2", "kl=kl", "kl.placement=reward"]


def train(overrides: list[str], run_dir: Path) -> None:
    from rlhf_lab.config import compose
    from rlhf_lab.training import run

    run(compose([*overrides, f"trainer.output_dir={run_dir}"]), run_dir)


def record_arm(overrides: list[str], work: Path) -> str:
    train(overrides, work)
    return (work / "metrics.jsonl").read_text()


def record_resume(work: Path, extra: list[str] | None = None) -> str:
    train([*RESUME_ARM, *(extra or []), "trainer.steps=2"], work)
    train([*RESUME_ARM, *(extra or []), "trainer.resume=auto"], work)
    return (work / "metrics.jsonl").read_text()


def main() -> None:
    sys.path.insert(0, str(GOLDEN_DIR.parents[1]))
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in arms().items():
            (GOLDEN_DIR / f"{name}.jsonl").write_text(record_arm(overrides, Path(tmp) / name))
            print("recorded", name)
        (GOLDEN_DIR / "resume_ppo.jsonl").write_text(record_resume(Path(tmp) / "resume"))
        print("recorded resume_ppo")


if __name__ == "__main__":
    main()
