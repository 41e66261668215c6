"""``rlhf-lab wandb sweep ...`` (a W&B sweep file from a Hydra sweep, :mod:`rlhf_lab.trackers.wandb_sweep`) and
``rlhf-lab wandb workspace ...`` (the KL-ablation workspace view, :mod:`rlhf_lab.trackers.wandb_workspace`)."""

from __future__ import annotations

import sys

from rlhf_lab.errors import UserError

COMMANDS = ("sweep", "workspace")


def main(args: list[str]) -> None:
    try:
        if not args or args[0] not in COMMANDS:
            given = repr(args[0]) if args else "nothing"
            raise UserError(f"rlhf-lab wandb takes a command, got {given}; choose from: {', '.join(COMMANDS)}")
        if args[0] == "sweep":
            from rlhf_lab.trackers.wandb_sweep import main as command
        else:
            from rlhf_lab.trackers.wandb_workspace import main as command
        command(args[1:])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
