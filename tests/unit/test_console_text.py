"""What reaches the console (rlhf_lab/runtime/console.py): a model's or an environment's text with terminal control
sequences in it is shown written out, never executed by the terminal; newlines and tabs stay."""

from __future__ import annotations

import logging

import pytest

from rlhf_lab.runtime.console import printable, say


@pytest.mark.parametrize(("text", "shown"), [
    ("clear\x1b[2Jscreen", "clear\\x1b[2Jscreen"),  # erase the display
    ("\x1b]0;owned\x07", "\\x1b]0;owned\\x07"),  # retitle the terminal (OSC ... BEL)
    ("done\rfake", "done\\x0dfake"),  # rewrite the line
    ("bell\x07 nul\x00 del\x7f csi\x9b", "bell\\x07 nul\\x00 del\\x7f csi\\x9b"),  # C0, DEL, C1
    ("two\nlines\tand a tab, ünïcode", "two\nlines\tand a tab, ünïcode"),
])
def test_control_characters_are_written_out(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_say_prints_and_logs_the_written_out_text(capsys, caplog, monkeypatch) -> None:
    say("response: \x1b[31mred\x1b[0m")
    assert capsys.readouterr().out == "response: \\x1b[31mred\\x1b[0m\n"
    monkeypatch.setattr("rlhf_lab.runtime.console._in_hydra_job", lambda: True)
    with caplog.at_level(logging.INFO, logger="rlhf_lab"):
        say("\x1b[2J")
    assert caplog.records[-1].getMessage() == "\\x1b[2J"
