"""A saved W&B workspace view for a KL ablation or an algorithm comparison: ``rlhf-lab wandb workspace``.

Built with ``wandb-workspaces`` (W&B's workspace API) from metric names rlhf_lab logs; runs are grouped by the
flat config keys every run carries (``algorithm_name``, ``kl_name``, ``kl_placement``), so seeds of one arm are
one line with a min–max band. Sections, top to bottom:

1. **Objective**: ``exact/gap`` (J* − J(π), log scale) and ``eval/reward/mean`` per step; a bar chart of the final
   gap per arm.
2. **Reward vs KL**: reward against the exact KL (a scatter of the runs' final values, one point per run), and
   reward and exact KL per step.
3. **KL estimate vs exact**: the configured estimator's value beside the exact KL per step, the estimator's
   expected value and its bias on the exact task (``exact/kl_estimate_expected``, ``exact/kl_estimate_bias``),
   and the per-sequence exact KL against the exact task's optimum.
4. **Clipping**: the share of tokens whose ratio clip binds, by side (``policy/clipped_low_frac``,
   ``policy/clipped_high_frac``, ``policy/dual_clipped_frac``), and the approximate KL between rollout and
   update policies.

Building needs no network (:func:`workspace` and :func:`spec` are offline); ``--save`` uploads the view to the
project (an API key), printing its URL.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rlhf_lab.errors import ToolError
from rlhf_lab.trackers.wandb_sweep import check_out, write_out

GROUP_BY = ("algorithm_name", "kl_name", "kl_placement")
SECTIONS: dict[str, list[dict[str, Any]]] = {
    "Objective": [
        {"kind": "line", "title": "gap to the optimum J* − J(π)", "y": ["exact/gap"], "log_y": True},
        {"kind": "line", "title": "evaluation reward", "y": ["eval/reward/mean"]},
        {"kind": "bar", "title": "final gap per arm", "y": ["exact/gap"]},
    ],
    "Reward vs KL": [
        {"kind": "scatter", "title": "reward vs exact KL (final, one point per run)", "x": "kl/exact_sequence",
         "y": "reward/mean"},
        {"kind": "line", "title": "reward", "y": ["reward/mean"]},
        {"kind": "line", "title": "exact KL per sequence", "y": ["kl/exact_sequence", "exact/kl_sequence"]},
    ],
    "KL estimate vs exact": [
        {"kind": "line", "title": "estimate vs exact (per token)", "y": ["kl/estimate", "kl/exact"]},
        {"kind": "line", "title": "estimator: expected value vs exact", "y": ["exact/kl_estimate_expected",
                                                                                "exact/kl_sequence"]},
        {"kind": "line", "title": "estimator bias", "y": ["exact/kl_estimate_bias"]},
        {"kind": "line", "title": "KL of π vs of π*", "y": ["exact/kl_sequence", "exact/kl_optimal"]},
    ],
    "Clipping": [
        {"kind": "line", "title": "clip fraction", "y": ["policy/clipfrac"]},
        {"kind": "line", "title": "clipped by side", "y": ["policy/clipped_low_frac", "policy/clipped_high_frac",
                                                           "policy/dual_clipped_frac"]},
        {"kind": "line", "title": "approximate KL, rollout vs update policy", "y": ["policy/approxkl"]},
    ],
}


def _panel(spec: dict[str, Any]) -> Any:
    import wandb_workspaces.reports.v2 as wr

    groupby = wr.Config(GROUP_BY[0])
    if spec["kind"] == "line":
        return wr.LinePlot(title=spec["title"], x="step", y=list(spec["y"]), log_y=spec.get("log_y"),
                           groupby=groupby, groupby_aggfunc="mean", groupby_rangefunc="minmax")
    if spec["kind"] == "scatter":
        return wr.ScatterPlot(title=spec["title"], x=wr.SummaryMetric(spec["x"]), y=wr.SummaryMetric(spec["y"]))
    return wr.BarPlot(title=spec["title"], metrics=list(spec["y"]), groupby=groupby, groupby_aggfunc="mean",
                      groupby_rangefunc="minmax")


def workspace(entity: str, project: str, name: str = "rlhf_lab: KL ablation", group: str | None = None) -> Any:
    """The view (a ``wandb_workspaces.workspaces.Workspace``); ``group`` shows that W&B group's runs only."""
    try:
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise ToolError("rlhf-lab wandb workspace needs wandb-workspaces; install it with: "
                        "pip install wandb-workspaces") from None
    from wandb_workspaces import expr

    runset = ws.RunsetSettings(
        groupby=[expr.Config(key) for key in GROUP_BY],
        filters=[expr.Metric("Group") == group] if group else [],
        pinned_columns=["summary:exact/gap/min", "summary:exact/gap", "summary:eval/reward/mean/max",
                        "summary:kl/exact_final"],
    )
    sections = [ws.Section(name=title, panels=[_panel(spec) for spec in panels], is_open=True)
                for title, panels in SECTIONS.items()]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        settings=ws.WorkspaceSettings(x_axis="step", max_runs=100), runset_settings=runset)


def spec(view: Any) -> dict[str, Any]:
    """The view as W&B stores it (its JSON spec), built offline."""
    return json.loads(view._to_model().model_dump_json(by_alias=True, exclude_none=True))


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="rlhf-lab wandb workspace",
        description="Build the W&B workspace view for comparing KL estimators, placements and algorithms "
                    "(reward vs exact KL, estimate vs exact, clip fractions); write its spec, or --save it.")
    parser.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"),
                        help="the W&B entity (user or team); needed by --save only (default: $WANDB_ENTITY)")
    parser.add_argument("--project", default="rlhf_lab", help="the W&B project (rlhf_lab)")
    parser.add_argument("--name", default="rlhf_lab: KL ablation", help="the view's name")
    parser.add_argument("--group", help="show only this W&B group's runs (a sweep's group)")
    parser.add_argument("--out", type=Path, help="write the view's JSON spec here")
    parser.add_argument("--save", action="store_true", help="save the view to W&B (needs an API key)")
    options = parser.parse_args(args)
    if options.entity is not None and not options.entity.strip():
        raise ToolError(f"--entity {options.entity!r} is empty; give your W&B user or team name")
    if options.save and not options.entity:
        raise ToolError("--save needs --entity (the W&B user or team the view is saved under); --out writes the spec "
                        "without one")
    view = workspace(options.entity or "", options.project, options.name, options.group)
    if options.out is not None:
        check_out(options.out, "workspace.json")
        write_out(options.out, json.dumps(spec(view), indent=1))  # as wandb sweep --out: a missing folder is made
        print(f"wrote {options.out}: {sum(len(p) for p in SECTIONS.values())} panels in {len(SECTIONS)} sections")
    if options.save:
        from rlhf_lab.trackers.wandb_run import has_api_key

        if not has_api_key():
            raise ToolError("--save needs a W&B API key (WANDB_API_KEY or `wandb login`); --out writes the spec")
        print(f"saved: {view.save().url}")
    if options.out is None and not options.save:
        raise ToolError("give --out FILE (the view's spec) or --save (upload it to W&B)")
