"""Every error a user can cause, under one base: the CLI prints a :class:`UserError` as one line, exit 2.

Each subclass names where the mistake was found; its message names the bad value and the valid choices.
``TrainingStopped`` is not a mistake: the run stopped on purpose (a signal, or too many skipped updates).
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


class ConfigError(UserError, ValueError):
    """A config value that cannot run; the message names the key, the value and what is allowed."""


class RegistryError(UserError, KeyError):
    """An unknown component kind or name; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it a plain line
        return str(self.args[0])


class DataError(UserError, ValueError):
    """Prompts or preference data that cannot be used; the message names the file and the problem."""


class RewardError(UserError, ValueError):
    """A reward that failed or broke its contract; one line naming the reward and, if known, the sample."""

    def __init__(self, message: str, sample: int | None = None) -> None:
        super().__init__(message)
        self.sample = sample  # index in the scored batch, when known


class EnvError(UserError, RuntimeError):
    """An environment that raised, broke its contract or timed out; one line naming the environment, the turn
    and the sample's prompt (``env.on_error=error``)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or resume target that cannot be used; the message is one line naming it."""


class RunFolderError(UserError, OSError):
    """A run folder's file that cannot be used safely (a symbolic link out of the folder); one line naming it."""


class ToolError(UserError):
    """Bad arguments or inputs of a sub-command (``report``, ``bench``)."""


class WeightSyncError(UserError, RuntimeError):
    """The generation engine does not hold the policy's weights after a weight sync (the canary,
    :mod:`rlhf_lab.generation.sync_check`); one line naming the step, the difference and the tolerance."""


class EngineError(UserError, RuntimeError):
    """The generation engine's process stopped answering mid-run (``rlhf-lab serve`` killed or crashed); one line
    naming it. What the run wrote before stays as it was."""


class TrainingStopped(RuntimeError):
    """The run stopped early on purpose, after writing a checkpoint: a signal, or too many skipped updates.

    ``exit_code`` is 128 + the signal number for a signal (130 for Ctrl-C, 143 for SIGTERM) and 3 for
    skipped updates; ``resume_overrides`` is the command-line fragment that continues the run.
    """

    def __init__(self, message: str, exit_code: int = 3, resume_overrides: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.resume_overrides = resume_overrides
