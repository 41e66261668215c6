"""The colocated vLLM engine builds from a folder the trainer writes: its floating-point weights in the engine's dtype
(bf16 under a bf16 precision: half the host memory and disk of float32), the same numbers the engine would hold."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from rlhf_lab.generation import vllm as vllm_engine
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.models import loading
from rlhf_lab.runtime.precision import Precision
from tests import fake_vllm


def header(path) -> dict:
    """A safetensors file's header: name -> {dtype, shape, offsets}."""
    with open(path, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        return {k: v for k, v in json.loads(handle.read(size)).items() if k != "__metadata__"}


@pytest.mark.parametrize(("precision", "stored"), [("fp32", "F32"), ("bf16-mixed", "BF16"), ("bf16-true", "BF16")])
def test_the_export_is_in_the_engine_s_dtype(compose, tiny_tokenizer, monkeypatch, precision, stored) -> None:
    fake_vllm.install(monkeypatch)
    cfg = compose(["model=tiny", "trainer.precision=fp32"])
    policy = loading.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0).eval()
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, SamplingSettings(max_new_tokens=2, max_prompt_tokens=16),
                                        precision=Precision(precision, "cpu"), options={"sleep": False})
    try:
        tensors = header(engine.folder / "base" / "model.safetensors")
        assert {entry["dtype"] for entry in tensors.values()} == {stored}
        assert fake_vllm.LLM.built[-1].kwargs["dtype"] == {"F32": "float32", "BF16": "bfloat16"}[stored]
        state = policy.state_dict()
        tied = {"lm_head.weight"} if policy.config.tie_word_embeddings else set()
        assert set(tensors) == set(state) - tied  # a tied weight once, as save_pretrained writes it
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[stored]
        from safetensors.torch import load_file

        saved = load_file(engine.folder / "base" / "model.safetensors")
        assert all(torch.equal(saved[name], state[name].to(dtype)) for name in saved)
    finally:
        engine.close()
