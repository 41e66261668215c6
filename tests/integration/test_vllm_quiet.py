"""The vLLM paths' console and files: vLLM's lines to the run's log file counted in one line, the rotary reload line
explained (and dropped), a model that does not match the server's in one line naming both, and no weights left in
the sync folder after a run (rlhf_lab/generation/vllm_logs.py, server.py, serving.py, vllm.py).

Only the last test needs vLLM (skipped without the extra); the others use the server's stand-in engine."""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path

import pytest
import torch

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation import serving
from rlhf_lab.generation.vllm_logs import RELOAD_LOGGER, VLLM_LOGGER, VLLMLogs
from tests import fake_vllm
from tests.integration.test_serve_security import StandInEngine
from tests.limits import HANG_GUARD_S

DIMS = ["model.tiny.hidden_size=128", "model.tiny.intermediate_size=256", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1"]


@pytest.fixture
def vllm_logging(tmp_path: Path):
    """vLLM's logger as vLLM configures it (its own console handler, no propagation) and a run's log file on the
    root logger, as in a Hydra job; both put back afterwards."""
    vllm, root = logging.getLogger(VLLM_LOGGER), logging.getLogger()
    console, log = io.StringIO(), tmp_path / "train.log"
    handler, file = logging.StreamHandler(console), logging.FileHandler(log)
    saved = (vllm.handlers[:], vllm.propagate, vllm.level)
    vllm.handlers[:], vllm.propagate = [handler], False
    vllm.setLevel(logging.INFO)
    root_handlers = root.handlers[:]  # an earlier in-process Hydra job of the same worker may have left its log file
    root.handlers[:] = [file]
    try:
        yield console, log, handler
    finally:
        root.handlers[:] = root_handlers
        file.close()
        vllm.handlers[:], vllm.propagate = saved[0], saved[1]
        vllm.setLevel(saved[2])


def test_vllm_lines_go_to_the_log_file_and_the_console_gets_one_line(vllm_logging) -> None:
    console, log, handler = vllm_logging
    logs = VLLMLogs()
    logging.getLogger("vllm.config").warning("dtype float32 differs from the checkpoint's")
    logging.getLogger("vllm.config").warning("dtype float32 differs from the checkpoint's")
    logging.getLogger("vllm.engine").info("Initializing a V1 LLM engine")
    logging.getLogger(RELOAD_LOGGER).warning("%s: Failed to load weights", "RotaryEmbedding")
    logging.getLogger(RELOAD_LOGGER).warning("%s: Failed to load weights", "QKVParallelLinear")
    logging.getLogger("vllm.engine").error("the engine died")
    assert console.getvalue() == "the engine died\n"  # errors still reach the console, nothing else
    written = log.read_text()
    assert written.count("differs from the checkpoint's") == 2 and "Initializing a V1 LLM engine" in written
    assert "QKVParallelLinear: Failed to load weights" in written  # a real failed load is kept
    assert "RotaryEmbedding" not in written and logs.rotary.dropped == 1
    line = logs.close()
    assert line == f"vLLM wrote 1 error, 3 warning, 1 info lines to {log} (its errors also print here)"
    assert handler.level == logging.NOTSET and logs.routed not in logging.getLogger(VLLM_LOGGER).handlers  # as it was
    logging.getLogger("vllm.engine").info("after the run")
    assert console.getvalue().endswith("after the run\n")


def test_without_a_log_file_vllm_keeps_its_console(vllm_logging) -> None:
    console, log, _ = vllm_logging
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    for file in files:
        root.removeHandler(file)
    try:
        logs = VLLMLogs()
        logging.getLogger("vllm.engine").warning("a warning")
        assert console.getvalue() == "a warning\n" and logs.close() is None
    finally:
        for file in files:
            root.addHandler(file)


def test_a_fresh_vllm_logger_is_routed_and_vllm_told_not_to_configure_it(tmp_path: Path, monkeypatch) -> None:
    """The usual case in a run: vLLM has not configured its logger yet (it does so when an engine is built, unless
    told not to): its records reach the log file only, its errors the run's console too."""
    vllm, root = logging.getLogger(VLLM_LOGGER), logging.getLogger()
    console, log = io.StringIO(), tmp_path / "train.log"
    stream, file = logging.StreamHandler(console), logging.FileHandler(log)
    saved = (vllm.handlers[:], vllm.propagate, root.handlers[:], root.level)
    vllm.handlers[:], vllm.propagate, root.handlers[:] = [], True, [stream, file]
    root.setLevel(logging.INFO)
    try:
        logs = VLLMLogs()
        logging.getLogger("vllm.triton_utils.importing").warning("Triton is installed, but has no CPU backend")
        logging.getLogger("vllm.engine").error("the engine died")
        assert console.getvalue() == "the engine died\n"
        assert "no CPU backend" in log.read_text() and "the engine died" in log.read_text()
        assert logs.close() == f"vLLM wrote 1 error, 1 warning lines to {log} (its errors also print here)"
        fake_vllm.install(monkeypatch)  # vllm.config.logging: the stand-in's (importing vLLM logs lines of its own)
        assert logs.engine_kwargs()["logging_config"].configure_logging is False
        assert vllm.propagate and vllm.handlers == []
        monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")  # the user's choice: vLLM's logging is theirs
        untouched = VLLMLogs()
        assert untouched.routed is None and untouched.engine_kwargs() == {} and untouched.close() is None
    finally:
        vllm.handlers[:], vllm.propagate, root.handlers[:] = saved[0], saved[1], saved[2]
        root.setLevel(saved[3])
        file.close()


@pytest.fixture
def client_and_server(compose, tiny_overrides, tmp_path: Path):
    """A trainer's client engine over the tiny policy and a server (stand-in engine) whose model is another one."""
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.server import VLLMServerGeneration
    from rlhf_lab.models.loading import build_policy, load_tokenizer

    cfg = compose(tiny_overrides(None))
    tokenizer = load_tokenizer(cfg.model)
    policy = build_policy(cfg.model, tokenizer, "float32", 0).policy
    served, sync = tmp_path / "SmolLM2-360M", tmp_path / "sync"
    served.mkdir()
    sync.mkdir()
    engine = StandInEngine({})
    started, holder = threading.Event(), {}
    thread = threading.Thread(target=serving.serve, args=(str(served), "127.0.0.1", 0), daemon=True, kwargs=dict(
        sync_folder=sync, engine_factory=lambda *args: engine,
        on_ready=lambda http: (holder.setdefault("http", http), started.set())))
    thread.start()
    assert started.wait(HANG_GUARD_S)
    url = f"http://127.0.0.1:{holder['http'].server_address[1]}"
    try:
        yield VLLMServerGeneration(policy, tokenizer, SamplingSettings(max_new_tokens=2),
                                   options={"url": url, "sync_folder": str(sync)}), engine, served, sync
    finally:
        holder["http"].shutdown()


def test_a_model_that_is_not_the_servers_is_one_line_naming_both(client_and_server) -> None:
    client, engine, served, _ = client_and_server

    def bare_assert(weights) -> int:  # vLLM's weight loader: `assert param.size() == loaded_weight.size()`
        for _ in weights:
            raise AssertionError
        return 0

    engine.load_weights = bare_assert
    with pytest.raises(ConfigError) as caught:
        client.sync_weights(client.policy)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (f"the trainer's model (LlamaForCausalLM) is not the one rlhf-lab serve at {client.url} "
                              f"serves ({served}): the weights sent do not fit the served model {served} at weight "
                              "'lm_head.weight' (AssertionError); the load stopped there; start the server with the "
                       "trainer's model")


def test_the_runs_weights_leave_the_sync_folder_at_its_end(client_and_server) -> None:
    client, engine, _, sync = client_and_server
    client.sync_weights(client.policy)
    client.sync_weights(client.policy)
    assert sorted(path.name for path in sync.iterdir()) == [serving.TOKEN_FILE, "v2"]  # v1 went at the second
    client.close()
    assert sorted(path.name for path in sync.iterdir()) == [serving.TOKEN_FILE]  # the next run still finds it
    assert engine.fed == ["stream", "stream"]


@pytest.mark.extra("vllm")
def test_the_rotary_reload_line_is_no_failed_load_and_the_engines_folder_goes(compose, monkeypatch) -> None:
    """At a sync vLLM warns ``RotaryEmbedding: Failed to load weights``: its rotary layer's only tensor is the
    cos/sin cache computed at start, which no checkpoint holds. The cache after the sync is the one before, and both
    are the policy's rotary frequencies (cos and sin of position × ``inv_freq``): nothing failed to load."""
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.vllm import VLLMGeneration
    from rlhf_lab.models import loading

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # vLLM's default: the line is a warning (TRL's import sets ERROR)
    cfg = compose(["model=tiny", "trainer.precision=fp32", *DIMS])
    tokenizer = loading.load_tokenizer(cfg.model)
    policy = loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).eval()
    engine = VLLMGeneration(policy, tokenizer, SamplingSettings(max_new_tokens=4, max_prompt_tokens=32))

    def rotary_caches(worker) -> dict[str, torch.Tensor]:  # noqa: ANN001  (runs on vLLM's worker)
        return {name: module.cos_sin_cache.clone() for name, module in worker.model_runner.model.named_modules()
                if "cos_sin_cache" in module._buffers}

    before = engine.llm.collective_rpc(rotary_caches)[0]
    # An in-process Hydra run earlier in this process (its logging dictConfig) may have disabled vLLM's loggers.
    monkeypatch.setattr(logging.getLogger(RELOAD_LOGGER), "disabled", False)
    engine.sync_weights(policy)
    after = engine.llm.collective_rpc(rotary_caches)[0]
    assert before and engine.logs.rotary.dropped == 1  # the line came, once per sync, and was dropped
    inv_freq = policy.model.rotary_emb.inv_freq.float()
    angles = torch.outer(torch.arange(next(iter(after.values())).shape[0]).float(), inv_freq)
    for name, cache in after.items():
        assert torch.equal(cache, before[name])
        torch.testing.assert_close(cache, torch.cat([angles.cos(), angles.sin()], -1), atol=1e-5, rtol=1e-5)
    engine.close()
    assert not engine.folder.exists()
