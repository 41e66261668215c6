"""Under FSDP only rank 0 reads the weights (gloo, 2 processes on the CPU): the other rank builds the model on the
meta device, and after sharding every rank's shards are rank 0's weights, broadcast. The frozen reference is made in
the compute dtype as it is copied (bfloat16 under bf16-mixed), never as a second float32 copy."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TINY = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)


def _model_cfg(folder: str) -> SimpleNamespace:
    return SimpleNamespace(name="path", name_or_path=folder, lora=SimpleNamespace(enabled=False))


def _rank(rank: int, store: str, folder: str, out: str) -> None:
    import transformers

    from rlhf_lab.models import loading
    from rlhf_lab.runtime import distributed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    reads = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def counted(*args, **kwargs):
        reads.append(str(args[0]))
        return original(*args, **kwargs)

    transformers.AutoModelForCausalLM.from_pretrained = counted
    try:
        tokenizer = loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))
        models = loading.build_policy(_model_cfg(folder), tokenizer, "float32", 0, reference_dtype=torch.bfloat16,
                                      every_reference_weight=True, meta=rank != 0)
        on_meta = distributed.on_meta(models.policy) and distributed.on_meta(models.reference)
        states = {"policy": models.policy.state_dict(), "reference": models.reference.state_dict()} \
            if rank == 0 else {}
        for name in ("policy", "reference"):
            module = getattr(models, name)
            distributed.shard(module, torch.bfloat16)
            distributed.load_from_rank0(module, states.get(name), torch.device("cpu"))
        # trainer.offload_reference under FSDP: the same reference, its shards kept in host memory (CPUOffloadPolicy)
        offloaded = loading.build_policy(_model_cfg(folder), tokenizer, "float32", 0, reference_dtype=torch.bfloat16,
                                         every_reference_weight=True, meta=rank != 0).reference
        distributed.shard(offloaded, torch.bfloat16, offload=True)
        distributed.load_from_rank0(offloaded, states.get("reference"), torch.device("cpu"))
        whole = {name: distributed.full_model_state(getattr(models, name)) for name in ("policy", "reference")}
        ids = torch.arange(2, 10).reshape(1, 8)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = models.policy(input_ids=ids).logits.float()
            same_offloaded = torch.equal(models.reference(input_ids=ids).logits, offloaded(input_ids=ids).logits)
        torch.save({"reads": reads, "on_meta": on_meta, "same_offloaded": same_offloaded, "whole": whole, "logits": logits,
                    "dtypes": sorted({str(p.dtype) for p in models.reference.parameters()})}, f"{out}.{rank}")
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = original
        dist.destroy_process_group()


def test_only_rank_zero_reads_the_weights_and_every_rank_gets_them(tmp_path: Path) -> None:
    from rlhf_lab.models import loading

    tokenizer = loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))
    saved = loading.build_tiny_llama(tokenizer, TINY, seed=3)
    saved.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "model"), str(tmp_path / "result")), nprocs=2,
             join=True)
    results = [torch.load(f"{tmp_path / 'result'}.{rank}", weights_only=True) for rank in (0, 1)]
    assert results[0]["reads"] == [str(tmp_path / "model")] * 2 and results[1]["reads"] == []
    assert results[0]["same_offloaded"] and results[1]["same_offloaded"]
    assert not results[0]["on_meta"] and results[1]["on_meta"]
    expected = saved.state_dict()
    policy = results[0]["whole"]["policy"]  # gathered from both ranks' shards
    assert policy.keys() and all(torch.equal(policy[name], expected[name]) for name in policy)
    reference = results[0]["whole"]["reference"]
    assert results[0]["dtypes"] == results[1]["dtypes"] == ["torch.bfloat16"]
    assert all(torch.equal(reference[name], expected[name].to(torch.bfloat16)) for name in reference)
    # The rotary frequencies (a buffer no state dict holds) arrived too: both ranks compute the same logits.
    torch.testing.assert_close(results[1]["logits"], results[0]["logits"], rtol=0, atol=0)


def test_the_reference_copy_is_made_in_the_compute_dtype() -> None:
    """bf16-mixed without FSDP: the untied matrices in bfloat16 (the tied head and embeddings, norms in float32),
    separate storage from the policy; in fp32 an exact float32 copy."""
    from rlhf_lab.models import loading

    tokenizer = loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))
    policy = loading.build_tiny_llama(tokenizer, TINY, seed=0)
    reference = loading.frozen_copy(policy, torch.bfloat16)
    layer, copied = policy.model.layers[0].mlp.up_proj.weight, reference.model.layers[0].mlp.up_proj.weight
    assert copied.dtype == torch.bfloat16 and torch.equal(copied, layer.detach().to(torch.bfloat16))
    assert reference.model.embed_tokens.weight.dtype == reference.model.norm.weight.dtype == torch.float32
    assert reference.lm_head.weight is reference.model.embed_tokens.weight  # still tied
    assert not any(p.requires_grad for p in reference.parameters())
    with torch.no_grad():
        layer.add_(1.0)  # training the policy leaves the copy as it was
    assert not torch.equal(copied.float(), layer.detach())
    exact = loading.frozen_copy(policy, None)
    assert all(p.dtype == torch.float32 for p in exact.parameters())
    assert all(torch.equal(a, b) for a, b in zip(exact.parameters(), policy.parameters()))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(exact.parameters(), policy.parameters()))


def test_a_rank_built_on_the_meta_device_is_in_rank_0_s_mode(tmp_path: Path) -> None:
    """Rank 0 reads a pretrained model with ``from_pretrained`` (eval mode: no dropout, the layers' cache on); a rank
    that builds the structure alone on the meta device is in the same mode, so every rank runs the same passes."""
    from rlhf_lab.models import loading

    tokenizer = loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))
    loading.build_tiny_llama(tokenizer, TINY, seed=3).save_pretrained(tmp_path)
    model_cfg = SimpleNamespace(name="path", name_or_path=str(tmp_path))
    read = loading.load_causal_lm(model_cfg, tokenizer, "float32", 0)
    built = loading.load_causal_lm(model_cfg, tokenizer, "float32", 0, meta=True)
    assert built.device == torch.device("meta") or next(built.parameters()).is_meta
    assert [m.training for m in built.modules()] == [m.training for m in read.modules()]
    assert not read.training
