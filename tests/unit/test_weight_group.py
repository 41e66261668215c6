"""The trainer–server weight group (``generation.weight_sync=collective``): what rank 0 sends, rank 1 receives
exactly, whatever the dtype and shape; and the config lines around it."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.weight_group import WeightGroup
from tests.limits import HANG_GUARD_S


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_weight_arrives_with_its_name_dtype_shape_and_bytes() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=generator)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 2, generator=generator).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(3, generator=generator).half()),
        ("步数", torch.tensor(7, dtype=torch.int64)),  # a 0-dim tensor and a name of non-ASCII bytes
        ("mask", torch.tensor([[True, False], [False, True]])),
        ("wide", torch.arange(2 * 3 * 1 * 2, dtype=torch.int32).reshape(2, 3, 1, 2)),
    ]
    port, received = free_port(), {}

    def server() -> None:
        group = WeightGroup("127.0.0.1", port, 1, "gloo")
        received["first"] = group.receive()
        received["second"] = group.receive()  # a second sync over the same group

    thread = threading.Thread(target=server)
    thread.start()
    sender = WeightGroup("127.0.0.1", port, 0, "gloo")
    for name, tensor in weights:
        sender.send(name, tensor)
    sender.end()
    sender.send("model.norm.weight", weights[2][1] * 2)
    sender.end()
    thread.join(timeout=HANG_GUARD_S)
    assert not thread.is_alive()
    assert [name for name, _ in received["first"]] == [name for name, _ in weights]
    for (_, sent), (_, got) in zip(weights, received["first"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    assert len(received["second"]) == 1 and torch.equal(received["second"][0][1], weights[2][1] * 2)


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^weight group backend='mpi' is not valid; choose from: nccl, gloo$"):
        WeightGroup("127.0.0.1", free_port(), 0, "mpi")


def test_weight_sync_values_and_the_folder_a_lora_adapter_needs(compose) -> None:
    server = ["model=tiny", "generation=vllm_server"]
    with pytest.raises(ConfigError, match=r"^generation.weight_sync='nccl' is not valid; choose from: folder, "
                                          r"collective$"):
        compose([*server, "generation.weight_sync=nccl"])
    with pytest.raises(ConfigError, match=r"needs generation.sync_folder: .* \(the policy's weights go through it "
                                          r"after every update\), or generation.weight_sync=collective$"):
        compose(server)
    cfg = compose([*server, "generation.weight_sync=collective"])  # full weights: no folder needed
    assert cfg.generation.weight_sync == "collective" and cfg.generation.sync_folder is None
    with pytest.raises(ConfigError, match=r"\(a LoRA adapter goes through it after every update\)$"):
        compose([*server, "generation.weight_sync=collective", "model.lora.enabled=true"])
