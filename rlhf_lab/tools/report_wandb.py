"""The report's claims into W&B (``rlhf-lab report --wandb auto|on|off``): one run of job type ``report`` in the
sweep's W&B group (project, entity and group from the jobs' ``wandb_run.json``), its summary the claims'
``claims/<name>/...`` keys (:meth:`rlhf_lab.tools.claims.ClaimResult.summary`). ``auto`` (the default) logs it when
the jobs logged to W&B; the mode follows the jobs' rule: online with an API key, else offline, never a prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_lab.tools.claims import ClaimResult
from rlhf_lab.trackers.wandb_run import resolve_mode, stored_run

CHOICES = ("auto", "on", "off")


def log_claims(jobs: list[Any], results: list[ClaimResult], folder: Path, out: Path, option: str) -> str | None:
    """Log the claims' summary as a W&B run; the line to print, or None when nothing was logged."""
    identities = [identity for identity in (stored_run(job.folder) for job in jobs) if identity]
    if not results or option == "off" or (option == "auto" and not identities):
        return None
    mode = resolve_mode("auto")
    if mode == "disabled":
        return None
    import wandb

    first = identities[0] if identities else {}
    group = first.get("group") or str(jobs[0].config.get("experiment_name", "report"))
    summary = {key: value for result in results for key, value in result.summary().items()}
    run = wandb.init(mode=mode, project=first.get("project") or "rlhf_lab", entity=first.get("entity"), group=group,
                     job_type="report", name=f"report {group}"[:128], dir=str(out), reinit="finish_previous",
                     config={"report_of": str(Path(folder).resolve())})
    run.summary.update(summary)
    run_id = run.id
    run.finish()
    return f"claims in the W&B summary of run {run_id} ({mode}, group {group})"
