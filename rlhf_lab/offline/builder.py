"""``data=embedded_preferences``: preference pairs built offline, with the labeller simulated by a gold reward.

For each embedded prompt, ``samples_per_prompt`` responses are sampled from ``model=`` and scored by the
``gold`` reward (VADER sentiment by default); the best and the worst become a pair (chosen, rejected, margin =
their gold gap) when the gap exceeds ``min_gap`` and their texts differ. The prompt set's own train / eval
splits are kept apart. The pairs are written once as jsonl (``train.jsonl``, ``eval.jsonl``) beside
``recipe.json`` (every setting that made them, and counts), in ``data.path`` or a cache folder named by the
recipe's hash, and read back by later runs with the same recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlhf_lab.errors import DataError
from rlhf_lab.runtime.cache import cache_dir

RECIPE = "recipe.json"
BUILDER_VERSION = 1  # bump when the procedure changes, so cached sets are rebuilt


def recipe_of(cfg: Any) -> dict[str, Any]:
    """Every setting the pairs depend on (the model, sampling, gold reward, seed)."""
    container = OmegaConf.to_container(cfg.data, resolve=True)
    keys = ("prompts", "max_prompts", "samples_per_prompt", "min_gap", "max_new_tokens", "temperature",
            "max_prompt_tokens", "gold")
    return {"version": BUILDER_VERSION, **{key: container[key] for key in keys},
            "model": OmegaConf.to_container(cfg.model, resolve=True), "seed": cfg.seed}


def preference_folder(cfg: Any) -> Path:
    if cfg.data.path:
        return Path(cfg.data.path).expanduser()
    digest = hashlib.sha256(json.dumps(recipe_of(cfg), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "preferences" / digest


def ensure_preferences(cfg: Any) -> Any:
    """Build the pairs unless a folder with this recipe exists; return a ``preferences`` data config for it."""
    folder = preference_folder(cfg)
    recipe = recipe_of(cfg)
    recipe_file = folder / RECIPE
    if recipe_file.is_file():
        saved = json.loads(recipe_file.read_text(encoding="utf-8"))
        if {k: v for k, v in saved.items() if k != "counts"} != recipe:
            raise DataError(f"data.path={str(folder)!r} holds preference pairs of another recipe; "
                            "choose another folder or delete it")
    else:
        build_preferences(cfg, folder, recipe)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    data.update({"path": str(folder), "format": "jsonl", "train_split": "train", "eval_split": "eval"})
    return OmegaConf.create(data)


@torch.no_grad()
def sample_pairs(model: Any, tokenizer: Any, prompts: list[str], gold: Any, cfg: Any) -> tuple[list[dict], int]:
    """(pairs, samples scored) for ``prompts``: best vs worst of ``samples_per_prompt`` gold-scored samples."""
    from rlhf_lab.data.prompts import format_prompts
    from rlhf_lab.generation.hf import generate

    data = cfg.data
    k = data.samples_per_prompt
    pairs, scored = [], 0
    for start in range(0, len(prompts), data.batch_prompts):
        chunk = prompts[start : start + data.batch_prompts]
        formatted = format_prompts(chunk, tokenizer, cfg.model.chat_template, cfg.model.system_prompt)
        rollout = generate(model, tokenizer, formatted, k, data.max_new_tokens, data.temperature, 1.0, 0,
                           data.max_prompt_tokens, keep_logits=False)
        mask = rollout.response_mask.long()
        responses = tokenizer.batch_decode(rollout.response_ids * mask + (1 - mask) * tokenizer.pad_token_id,
                                           skip_special_tokens=True)
        scores = gold([p for p in chunk for _ in range(k)], responses).scores.float().view(len(chunk), k)
        scored += len(responses)
        for index, prompt in enumerate(chunk):
            best, worst = int(scores[index].argmax()), int(scores[index].argmin())
            gap = float(scores[index, best] - scores[index, worst])
            chosen, rejected = responses[index * k + best], responses[index * k + worst]
            if gap > data.min_gap and chosen.strip() and rejected.strip() and chosen != rejected:
                pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": gap,
                              "chosen_score": float(scores[index, best]),
                              "rejected_score": float(scores[index, worst])})
        print(f"  {start + len(chunk)}/{len(prompts)} prompts sampled, {len(pairs)} pairs", flush=True)
    return pairs, scored


def build_preferences(cfg: Any, folder: Path, recipe: dict[str, Any]) -> Path:
    """Sample, score and write the pairs of both splits with their recipe (atomically: a folder appears whole)."""
    from rlhf_lab.data.prompts import load_prompts
    from rlhf_lab.models.loading import load_causal_lm, load_tokenizer
    from rlhf_lab.rewards.base import build_reward

    data = cfg.data
    prompt_cfg = OmegaConf.create({"name": data.prompts, "prompt_column": "prompt", "train_split": "train",
                                   "eval_split": "eval", "eval_fraction": 0.0, "max_prompt_tokens": data.max_prompt_tokens})
    splits = load_prompts(prompt_cfg, seed=cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    model_cfg = OmegaConf.merge(cfg.model, {"lora": {"enabled": False}})
    model = load_causal_lm(model_cfg, tokenizer, "float32", cfg.seed).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    gold = build_reward(OmegaConf.create(dict(recipe["gold"])))
    limit = data.max_prompts
    chosen = {"train": splits.train[:limit] if limit else splits.train,
              "eval": splits.eval[: max(1, limit // 4)] if limit else splits.eval}
    print(f"building preference pairs: {len(chosen['train'])} + {len(chosen['eval'])} prompts x "
          f"{data.samples_per_prompt} samples, gold reward {recipe['gold']['name']} -> {folder}")
    counts: dict[str, int] = {}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            for split, prompts in chosen.items():
                pairs, scored = sample_pairs(model, tokenizer, prompts, gold, cfg)
                counts[f"{split}_prompts"], counts[f"{split}_pairs"] = len(prompts), len(pairs)
                counts[f"{split}_samples"] = scored
                with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as handle:
                    handle.writelines(json.dumps(pair) + "\n" for pair in pairs)
        if not counts["train_pairs"]:
            raise DataError(f"no prompt's gold gap exceeded data.min_gap={data.min_gap}: no pairs; lower it")
        (tmp / RECIPE).write_text(json.dumps({**recipe, "counts": counts}, indent=2), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"preference pairs: {counts}")
    return folder
