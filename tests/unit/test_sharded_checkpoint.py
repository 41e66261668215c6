"""An FSDP checkpoint is DCP shards only, each rank hashing and reading its own (gloo, 2 processes on the CPU).

Two ranks shard a tiny Llama, take one AdamW step and save the checkpoint as the trainer does (every rank its shards
and their digests, rank 0 the rest). Then: no whole weights were written, rank 0 hashed none of rank 1's shard files,
a fresh pair of ranks resumes to the same shards and optimizer state, and a shard of rank 1 damaged on disk is found
by rank 1 (both ranks agree on the answer). Exported in one process, the shards give the whole model back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DIMS = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)
CONFIG = {"model": {"name": "tiny", "name_or_path": None, "tiny": vars(DIMS), "lora": {"enabled": False}}, "seed": 5}


def _model_and_optimizer(tokenizer, seed: int):
    from rlhf_lab.models import loading
    from rlhf_lab.runtime import distributed

    model = distributed.shard(loading.build_tiny_llama(tokenizer, DIMS, seed=seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _local(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every weight and of AdamW's moments."""
    values = {f"w.{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for parameter, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            values[f"{key}.{names[id(parameter)]}"] = state[key].to_local().clone()
    return values


def _rank(rank: int, store: str, root: str, out: str) -> None:
    from rlhf_lab.models import loading
    from rlhf_lab.runtime import distributed
    from rlhf_lab.training import checkpoint as ckpt
    from rlhf_lab.training import resume_contract, verify

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    hashed: list[str] = []
    original_digest = verify.file_digest

    def recorded(path):
        hashed.append(Path(path).name)
        return original_digest(path)

    verify.file_digest = recorded
    try:
        tokenizer = loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))
        model, optimizer = _model_and_optimizer(tokenizer, seed=0)
        ids = torch.randint(0, len(tokenizer), (2, 8), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        whole = distributed.full_model_state(model)  # rank 0's reference for the export below
        if rank == 0:
            torch.save(whole, f"{out}.whole")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

        checkpoints = Path(root) / "checkpoints"
        staged = ckpt.staging_folder(checkpoints, 1)
        if rank == 0:
            ckpt.prepare_staging(checkpoints, 1)
        dist.barrier()
        ckpt.save_sharded(staged, model, {}, optimizer)
        digests = [None, None]
        dist.all_gather_object(digests, ckpt.own_shard_digests(staged, rank))
        if rank == 0:
            ckpt.save_checkpoint(checkpoints, 1, model, tokenizer, {}, optimizer, scheduler, {}, keep_last_n=0,
                                 config=CONFIG, staged=staged,
                                 shard_digests={k: v for own in digests for k, v in own.items()})
        dist.barrier()
        hashed_at_save = list(hashed)
        folder = checkpoints / "step_1"

        hashed.clear()
        clean = resume_contract.checkpoint_damage(folder)
        hashed_at_check = list(hashed)
        fresh, fresh_optimizer = _model_and_optimizer(tokenizer, seed=1)  # other weights, no optimizer state
        ckpt.load_checkpoint(folder, fresh, {}, fresh_optimizer, scheduler, uses_adapter=False, sharded=True)
        same = {name: torch.equal(value, _local(fresh, fresh_optimizer)[name])
                for name, value in _local(model, optimizer).items()}

        dist.barrier()
        if rank == 0:  # a clean copy kept (for the export below), then one byte of rank 1's shard file flipped
            shutil.copytree(folder, Path(root) / "clean" / "checkpoints" / "step_1")
            shard = folder / "sharded" / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        damaged = resume_contract.checkpoint_damage(folder)
        torch.save({"clean": clean, "damaged": damaged, "same": same, "hashed_at_save": hashed_at_save,
                    "hashed_at_check": hashed_at_check,
                    "files": sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())},
                   f"{out}.{rank}")
    finally:
        verify.file_digest = original_digest
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    mp.spawn(_rank, args=(str(root / "store"), str(root / "run"), str(root / "result")), nprocs=2, join=True)
    return root


def test_sharded_checkpoints_are_hashed_and_read_by_their_own_ranks(sharded_run: Path) -> None:
    results = [torch.load(f"{sharded_run / 'result'}.{rank}", weights_only=True) for rank in (0, 1)]
    files = results[0]["files"]
    assert not any(name.startswith("model/") for name in files)  # no whole weights gathered
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata"} <= set(files)
    assert "tokenizer/tokenizer_config.json" in files
    # Each rank hashed its own shard file at the save and at the check, never the other's.
    for rank, result in enumerate(results):
        other = f"__{1 - rank}_0.distcp"
        assert f"__{rank}_0.distcp" in result["hashed_at_save"] and other not in result["hashed_at_save"]
        assert f"__{rank}_0.distcp" in result["hashed_at_check"] and other not in result["hashed_at_check"]
        assert result["clean"] is None
        assert result["same"] and all(result["same"].values()), result["same"]
        assert result["damaged"] == "found by rank 1: sharded/__1_0.distcp does not match its sha256 (corrupted)"


def test_which_rank_hashes_which_file() -> None:
    from rlhf_lab.training.checkpoint_sharded import hashed_by, shard_writer

    assert (shard_writer("sharded/__1_0.distcp"), shard_writer("sharded/.metadata"), shard_writer("x/__1_0.distcp")) \
        == (1, None, None)
    assert hashed_by("sharded/__1_0.distcp", 1, 2) and not hashed_by("sharded/__1_0.distcp", 0, 2)
    assert hashed_by("sharded/__3_0.distcp", 1, 2)  # written by 4 ranks, read by 2: spread over them
    assert hashed_by("rng.safetensors", 0, 2) and hashed_by("rng.safetensors", 1, 2)
    # The end-of-run export (the whole policy, not read on a resume from shards): rank 0 alone.
    assert hashed_by("model/model.safetensors", 0, 2) and not hashed_by("model/model.safetensors", 1, 2)


def test_shards_export_to_the_whole_model_in_one_process(sharded_run: Path, tmp_path: Path) -> None:
    """``rlhf-lab export`` of the shards-only checkpoint: assembled in one process without a process group, they are
    the trained weights, every one, with the run's tokenizer."""
    from transformers import AutoModelForCausalLM

    from rlhf_lab.errors import CheckpointError
    from rlhf_lab.tools.export import export

    with pytest.raises(CheckpointError, match=r"is damaged \(sharded/__1_0.distcp does not match its sha256"):
        export(sharded_run / "run" / "checkpoints" / "step_1", tmp_path / "damaged")
    export(sharded_run / "run" / "clean" / "checkpoints" / "step_1", tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).state_dict()
    whole = torch.load(f"{sharded_run / 'result'}.whole", weights_only=True)
    assert whole.keys() <= exported.keys()
    for name, value in whole.items():
        assert torch.equal(exported[name], value), name
    assert (tmp_path / "export" / "tokenizer_config.json").is_file() and (tmp_path / "export" / "README.md").is_file()
