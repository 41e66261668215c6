"""The printed form of a bench report: per-row phase times, ratios against TRL, skips and the scaling grid."""

from __future__ import annotations

from typing import Any

PHASES = ("generate", "reward", "reference", "advantages", "policy_forward_backward", "optimizer", "sync_weights")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip()
             for line in (headers, ["-" * w for w in widths], *rows)]
    return "\n".join(lines)


def _number(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _reward_cell(summary: dict[str, Any]) -> str:
    """Mean reward, with the standard deviation of the per-run means when there are several runs."""
    spread = summary.get("reward_mean_sd_over_runs")
    cell = _number(summary["reward_mean"], 3)
    return cell if spread is None else f"{cell} ± {spread:.3f} ({len(summary['reward_mean_per_run'])} runs)"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables: per-phase times per row and framework, ratios, and the scaling grid."""
    out = []
    if report["rows"]:
        headers = ["row", "framework", "s/step (median)", "generate", "reward", "reference", "advantages",
                   "fwd+bwd", "optimizer", "sync", "other", "tokens/s", "peak RSS MiB", "reward mean"]
        lines, notes = [], []
        for row in report["rows"]:
            for framework, entry in row["frameworks"].items():
                summary = entry.get("summary", {})
                if "skipped" in entry or "error" in summary:
                    notes.append(f"{row['row']} {framework}: not run: {entry.get('skipped') or summary['error']}")
                    continue
                phases = summary["phases_s_mean"]
                lines.append([row["row"], framework, _number(summary["step_s_median"]),
                              *(_number(phases.get(name, 0.0)) for name in PHASES), _number(summary["other_s_mean"]),
                              _number(summary["tokens_per_s"], 1), _number(summary["peak_rss_mib"], 0),
                              _reward_cell(summary)])
            floor = row["frameworks"].get("rlhf_lab", {}).get("summary", {})
            if floor.get("sync_check_s_mean"):
                notes.append(f"{row['row']}: weight-sync canary {_number(floor['sync_check_s_mean'], 3)} s per step "
                             f"({100 * floor['sync_check_s_mean'] / floor['step_s_mean']:.1f}% of the mean step; "
                             "inside 'generate')")
            if floor.get("peak_gpu_mib") is not None:
                mfu = floor.get("mfu_median")
                notes.append(f"{row['row']}: peak GPU memory {_number(floor['peak_gpu_mib'], 0)} MiB (allocator), "
                             f"MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'} (median step)")
            if floor.get("generation_over_floor") is not None:
                notes.append(f"{row['row']}: generation {_number(floor['generation_over_floor'])}x its floor "
                             f"({_number(floor['generation_floor_s_mean'])} s, {floor['generation_floor_bound']}-bound "
                             "on this machine's measured bandwidth and matrix FLOP rate)")
            ratio = row.get("ratio_rlhf_lab_over_trl")
            if ratio:
                notes.append(f"{row['row']}: rlhf_lab / trl = {_number(ratio['step_s_median'])}x time per step "
                             f"(medians), {_number(ratio['peak_rss_mib'])}x peak RSS, "
                             f"{_number(ratio.get('generate_s_mean'))}x generation phase")
        out += ["Per-phase seconds are means over measured steps; 'other' = mean step - their sum.",
                _table(headers, lines), *notes]
    if report["scaling"]:
        lengths = sorted({cell["max_new_tokens"] for cell in report["scaling"]})
        grid: dict[tuple[int, int], dict[str, Any]] = {(c["samples"], c["max_new_tokens"]): c for c in report["scaling"]}
        lines = []
        for samples in sorted({cell["samples"] for cell in report["scaling"]}):
            first = next(c for (s, _), c in grid.items() if s == samples)
            cells = []
            for length in lengths:
                summary = grid[(samples, length)]["summary"] if (samples, length) in grid else {"error": "-"}
                cells.append("failed" if "error" in summary else
                             f"{summary['step_s_median']:.2f} s, {summary['tokens_per_s']:.0f} tok/s, "
                             f"{summary['peak_rss_mib']:.0f} MiB")
            lines.append([f"{samples} ({first['prompts_per_step']}x{first['group_size']})", *cells])
        out += [*([""] if out else []), "rlhf_lab scaling: median s/step, tokens/s, peak RSS; rows = samples "
                "(prompts x group), columns = new tokens", _table(["samples", *(f"{n} tokens" for n in lengths)], lines)]
    return "\n".join(out)
