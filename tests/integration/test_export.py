"""``rlhf-lab export``: a LoRA run merged (equal outputs to base + adapter) or kept as an adapter with the base
given; a fully fine-tuned run as saved; model card; push to the Hub with the upload mocked; one-line mistakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlhf_lab
from rlhf_lab.tools import export as export_tool

TINY = ["model=tiny", "trainer.steps=1", "trainer.eval_prompts=0", "trainer.progress_bar=false",
        "algorithm.group_size=2", "trainer.prompts_per_step=2", "trainer.max_new_tokens=4", "trainer.lr=1e-2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    rlhf_lab.train([*TINY, "model.lora.enabled=true", "model.lora.r=2", "model.lora.target_modules=[q_proj,v_proj]"],
                   run_dir=run_dir)
    return run_dir


def test_lora_run_is_merged_with_the_same_outputs(lora_run: Path, tmp_path: Path, run_cli) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_lab.models.loading import build_tiny_llama, load_tokenizer, peft_wrapping

    out = tmp_path / "merged"
    code, printed, _ = run_cli(["export", str(lora_run), str(out)])
    assert code == 0 and "exported" in printed
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name in merged.state_dict())
    config = rlhf_lab.compose(TINY)
    base = build_tiny_llama(load_tokenizer(config.model), config.model.tiny, seed=0)
    with peft_wrapping():
        reference = PeftModel.from_pretrained(base, str(lora_run / "checkpoints" / "step_1" / "model"))
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-4)
    assert AutoTokenizer.from_pretrained(out) is not None
    card = (out / "README.md").read_text()
    assert "| `kl.name` | k3 |" in card and "| `model.lora.enabled` | True |" in card


def test_lora_kept_as_adapter_names_the_given_base(lora_run: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "adapter"
    code, _, err = run_cli(["export", str(lora_run), str(out), "--adapter"])
    assert code == 2 and err.startswith("error: --adapter needs --base MODEL_ID_OR_PATH") and err.count("\n") == 1
    code, _, _ = run_cli(["export", str(lora_run / "checkpoints" / "step_1"), str(out), "--adapter",
                          "--base", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert code == 0
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in (out / "README.md").read_text()


def test_full_fine_tuning_run_and_push_to_hub_with_the_upload_mocked(tmp_path: Path, monkeypatch, run_cli) -> None:
    import huggingface_hub

    run_dir = tmp_path / "run"
    rlhf_lab.train(TINY, run_dir=run_dir)
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo, **kw: calls.append(("create", kw)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, **kw: calls.append(("upload", kw)) or "https://hub/commit/1")
    out = tmp_path / "full"
    code, printed, _ = run_cli(["export", str(run_dir), str(out), "--push-to-hub", "me/policy", "--private"])
    assert code == 0, printed
    assert calls[0] == ("create", {"private": True, "exist_ok": True})
    assert calls[1][1]["folder_path"] == str(out) and calls[1][1]["repo_id"] == "me/policy"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert "## Results (summary.json)" in (out / "README.md").read_text()


def test_mistakes_are_one_line(lora_run: Path, tmp_path: Path, run_cli) -> None:
    code, _, err = run_cli(["export", str(tmp_path / "missing"), str(tmp_path / "o")])
    assert code == 2 and "does not exist; give a run folder" in err and err.count("\n") == 1
    (tmp_path / "empty_run").mkdir()
    code, _, err = run_cli(["export", str(tmp_path / "empty_run"), str(tmp_path / "o")])
    assert code == 2 and "holds no checkpoint with a model" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_text("x")
    code, _, err = run_cli(["export", str(lora_run), str(busy)])
    assert code == 2 and "exists and is not empty" in err and "--force" in err and err.count("\n") == 1
    code, _, err = run_cli(["export", str(lora_run), str(busy), "--force"])
    assert code == 0 and (busy / "model.safetensors").is_file()
    # A link in OUT's place, or inside it, would let --force write into a folder the command never named.
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    code, _, err = run_cli(["export", str(lora_run), str(tmp_path / "link"), "--force"])
    assert (code, err) == (2, f"error: {str(tmp_path / 'link')!r} is a symbolic link (to {str(outside)!r}); give the "
                              "folder itself\n")
    (busy / "model.safetensors").unlink()
    (busy / "model.safetensors").symlink_to(outside / "weights")
    code, _, err = run_cli(["export", str(lora_run), str(busy), "--force"])
    assert (code, err) == (2, f"error: {str(busy)!r} holds symbolic links (model.safetensors); --force writes only "
                              "into regular files: remove them or choose another folder\n")
    assert list(outside.iterdir()) == []  # nothing written through either link


def test_model_card_without_summary() -> None:
    card = export_tool.model_card({"algorithm": {"name": "grpo"}}, {}, Path("run/checkpoints/step_3"), None)
    assert card.startswith("---\nlibrary_name: transformers") and "(step 3: the policy after 3 updates)" in card
