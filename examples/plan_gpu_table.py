"""The predicted peaks of docs/guides/plan.md: ``rlhf-lab plan`` for Qwen2.5 and Llama shapes, no weights, no GPU.

Each model is a folder with a ``config.json`` (the shapes below, as the models publish them) and the embedded
tokenizer (the vocabulary size comes from the config). Run: ``python examples/plan_gpu_table.py [NAME ...]
[-- OVERRIDES]``; it prints one line of JSON per model and setting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # config.json of each model (architecture fields only)
    "qwen2.5-0.5b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936,
                     "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "llama-3.2-1b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                     "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "qwen2.5-3b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936,
                   "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen2.5-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
                   "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "llama-3.1-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
}
SETTINGS = {  # name -> (plan flags and overrides)
    "1x80": ["--device", "cuda", "--device-memory", "80"],
    "8x80 fsdp": ["--device", "cuda", "--device-memory", "80", "--world-size", "8", "trainer.strategy=fsdp"],
}


def model_folder(name: str, root: Path) -> Path:
    """A folder with ``name``'s config.json and the embedded tokenizer: what ``model=path`` reads."""
    from transformers import AutoConfig

    from rlhf_lab.config import compose
    from rlhf_lab.models.loading import load_tokenizer

    folder = root / name
    shape = dict(SHAPES[name])
    AutoConfig.for_model(shape.pop("model_type"), **shape).save_pretrained(folder)
    load_tokenizer(compose(["model=tiny"]).model).save_pretrained(folder)
    return folder


def main(argv: list[str]) -> None:
    names, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    names = names or list(SHAPES)
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            folder = model_folder(name, Path(root))
            for setting, flags in SETTINGS.items():
                done = subprocess.run([sys.executable, "-m", "rlhf_lab", "plan", "model=path",
                                       f"model.name_or_path={folder}", *overrides, *flags],
                                      capture_output=True, text=True, check=False)
                last = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr.strip()
                print(json.dumps({"model": name, "setting": setting, "overrides": overrides,
                                  "plan": json.loads(last) if done.returncode == 0 else last}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
