"""A multi-process run's faults, the parts that need no second process: which launch variables describe a launch,
which rank reports an error, the stop decision in one process, the collective timeout's range."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from rlhf_lab.config.validate_scale import check_launch_environment
from rlhf_lab.errors import ConfigError
from rlhf_lab.runtime import rank_output
from rlhf_lab.training.loop import Trainer

TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ", [
    {}, TORCHRUN, {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"},  # another launcher
    {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
], ids=["one_process", "torchrun", "launcher_with_local_rank", "world_of_one"])
def test_launches_are_accepted(environ: dict[str, str]) -> None:
    check_launch_environment(environ)


def test_a_world_of_two_without_local_rank_is_no_launch() -> None:
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError, match=r"^RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.7 MASTER_PORT=29500 names 2 "
                                          r"processes, but no launcher started this one \(LOCAL_RANK unset"):
        check_launch_environment(environ)


@pytest.mark.parametrize(("environ", "rank"), [
    ({}, 0), (TORCHRUN, 1), ({**TORCHRUN, "RANK": "0"}, 0),
    ({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}, 0),  # not torchrun: every rank reports
    ({**TORCHRUN, "WORLD_SIZE": "1"}, 0),
], ids=["one_process", "torchrun_rank_1", "torchrun_rank_0", "other_launcher", "torchrun_of_one"])
def test_launch_rank_is_torchruns_rank_of_several(monkeypatch, environ: dict[str, str], rank: int) -> None:
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert rank_output.launch_rank() == rank


def test_rank_zero_reports_at_once_and_a_quiet_rank_speaks_if_the_launch_goes_on(monkeypatch, capsys) -> None:
    """Before the process group exists, rank 1 of torchrun waits for rank 0's exit (the launcher stops it then);
    still running after the wait, the error was its own, and it prints it."""
    waits: list[float] = []
    monkeypatch.setattr(rank_output.time, "sleep", waits.append)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    rank_output.report_error("error: bad value")
    assert (waits, capsys.readouterr().err) == ([rank_output.ERROR_WAIT_S], "error: bad value\n")
    monkeypatch.setenv("RANK", "0")
    rank_output.report_error("error: bad value")
    assert (waits, capsys.readouterr().err) == ([rank_output.ERROR_WAIT_S], "error: bad value\n")


def test_one_process_stops_on_its_own_request_only() -> None:
    idle = SimpleNamespace(stop_requested=None, stop_signal=None)
    assert not Trainer.agree_on_stop(idle)
    signalled = SimpleNamespace(stop_requested="received SIGTERM", stop_signal=signal.SIGTERM)
    assert Trainer.agree_on_stop(signalled)
    assert (signalled.stop_requested, signalled.stop_signal) == ("received SIGTERM", signal.SIGTERM)


def test_the_collective_timeout_must_be_positive(compose) -> None:
    with pytest.raises(ConfigError, match=r"trainer.collective_timeout_s"):
        compose(["model=tiny", "trainer.collective_timeout_s=0"])
    assert compose(["model=tiny", "trainer.collective_timeout_s=30"]).trainer.collective_timeout_s == 30
