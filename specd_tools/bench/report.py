"""Writes a ``specd bench`` report: JSON, a Markdown table and PNG plots (matplotlib, the
optional ``bench`` extra)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DEFAULT_PATH_TARGETS", "TARGETS", "check_targets", "default_path_markdown",
           "forward_targets", "markdown", "write_plots", "write_report"]

#: The issue's targets (ratios within one run): (label, workload, numerator system,
#: denominator system or None for the plain-decode overhead, bound, "ge" | "le").
TARGETS = (
    ("code editing: adaptive >= 3.2x specd plain", "code_edit", "specd-prompt-lookup-adaptive",
     "specd-plain", 3.2, "ge"),
    ("code editing: adaptive >= 1.2x HF prompt lookup", "code_edit",
     "specd-prompt-lookup-adaptive", "hf-prompt-lookup", 1.2, "ge"),
    ("open questions: adaptive >= 0.98x specd plain", "open_question",
     "specd-prompt-lookup-adaptive", "specd-plain", 0.98, "ge"),
)
OVERHEAD_TARGET = 0.10
#: specd's forward over transformers' at these k (over FORWARD_TARGET_CACHE_LEN cached
#: tokens) must be at most 1.0.
FORWARD_TARGET_KS = (1, 2, 4, 8)
FORWARD_TARGET_CACHE_LEN = 300
#: --default-path targets: (label, workload or None for every workload, system, bound),
#: each a paired tok/s ratio to hf-plain that must be at least the bound.
DEFAULT_PATH_TARGETS = (
    ("code editing: specd generate >= 1.3x transformers plain", "code_edit",
     "specd-generate", 1.3),
    ("open questions: specd generate >= 0.95x transformers plain", "open_question",
     "specd-generate", 0.95),
    ("specd generate --drafter none >= 0.9x transformers plain", None,
     "specd-generate-drafter-none", 0.9),
)


def forward_targets(report: dict) -> list[dict]:
    """specd forward / transformers forward <= 1.0 at each target k (None: not measured)."""
    rows = {(r["cache_len"], r["k"]): r for r in report.get("forward") or []}
    out = []
    for k in FORWARD_TARGET_KS:
        row = rows.get((FORWARD_TARGET_CACHE_LEN, k))
        value = None if row is None else row["ratio"]
        out.append({"target": f"forward k={k} ({FORWARD_TARGET_CACHE_LEN} cached): specd / "
                              "transformers <= 1.0", "value": value, "bound": 1.0,
                    "met": None if value is None else value <= 1.0})
    return out


def default_path_targets(report: dict) -> list[dict]:
    """The --default-path targets with their measured paired ratios to hf-plain."""
    out = []
    workloads = list(dict.fromkeys(r["workload"] for r in report["summary"]))
    for label, workload, system, bound in DEFAULT_PATH_TARGETS:
        for w in ([workload] if workload else workloads):
            row = _row(report["summary"], w, system)
            value = None if row is None else row["ratio_to_plain"]
            out.append({"target": label if workload else f"{w}: {label}", "value": value,
                        "bound": bound, "met": None if value is None else value >= bound})
    return out + forward_targets(report)


def _row(summary: list[dict], workload: str, prefix: str) -> dict | None:
    # HF prompt lookup's name carries its draft length (hf-prompt-lookup-k10): match a prefix.
    for row in summary:
        if row["workload"] == workload and (row["system"] == prefix
                                            or row["system"].startswith(prefix + "-k")):
            return row
    return None


def check_targets(report: dict) -> list[dict]:
    """Each target with its measured value and whether it is met (None: not measured)."""
    if report.get("mode") == "default-path":
        return default_path_targets(report)
    out = []
    summary = report["summary"]
    for label, workload, num, den, bound, how in TARGETS:
        a, b = _row(summary, workload, num), _row(summary, workload, den)
        value = None
        if a is not None and b is not None:
            if den == "specd-plain":
                value = a["ratio_to_plain"]
            elif a["ratio_to_plain"] and b["ratio_to_plain"]:
                # Both paired against plain in the same repeats: their quotient is paired too.
                value = a["ratio_to_plain"] / b["ratio_to_plain"]
        out.append({"target": label, "value": value, "bound": bound,
                    "met": None if value is None else (value >= bound if how == "ge"
                                                       else value <= bound)})
    overhead = report.get("overhead")
    value = None if overhead is None else overhead["overhead"]
    out.append({"target": "plain-decode overhead <= 10% over a bare forward", "value": value,
                "bound": OVERHEAD_TARGET,
                "met": None if value is None else value <= OVERHEAD_TARGET})
    return out + (forward_targets(report) if report.get("forward") else [])


def forward_markdown(report: dict) -> list[str]:
    """The forward-timing table (empty when not run)."""
    rows = report.get("forward")
    if not rows:
        return []
    lines = ["", "One target forward of k tokens over L cached tokens, median ms, interleaved "
             "call by call; ratio: median of paired specd / transformers (< 1: specd faster).",
             "", "| L | k | bare-forward ms | hf-plain ms | ratio | max logit diff |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cache_len']} | {r['k']} | {r['bare_forward_ms']:.1f} | "
                     f"{r['hf_plain_ms']:.1f} | {r['ratio']:.2f} | {r['max_logit_diff']:.1e} |")
    return lines


def threads_markdown(report: dict) -> list[str]:
    """The thread check's table (empty when not run)."""
    rows = report.get("threads")
    if not rows:
        return []
    lines = ["", "specd's forward (300 cached tokens) by torch threads, quiet and beside one busy "
             "process (`while True: pass`), median and worst ms, interleaved:", "",
             "| beside a busy process | k | threads | median ms | worst ms |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {'yes' if r['busy'] else 'no'} | {r['k']} | {r['threads']} | "
                     f"{r['median_ms']:.1f} | {r['max_ms']:.0f} |")
    return lines


def _targets_markdown(report: dict) -> list[str]:
    lines = ["", "| target | measured | met |", "|---|---:|---|"]
    for t in check_targets(report):
        value = "-" if t["value"] is None else (
            f"{100 * t['value']:+.1f}%" if "overhead" in t["target"] else f"{t['value']:.2f}x")
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {value} | {met} |")
    return lines


def default_path_markdown(report: dict) -> str:
    """A ``--default-path`` report as Markdown: forward per k, then the default user path
    against transformers per workload, identity and the issue's targets."""
    cfg, env = report["config"], report["environment"]
    lines = [
        f"# specd bench --default-path ({env['time_utc']})",
        "",
        f"Model {cfg['model'] or 'SmolLM2-135M-Instruct (default)'}, greedy, "
        f"max_new_tokens={cfg['max_new_tokens']}, repeats={cfg['repeats']}, torch "
        f"{env['torch']} on {env['cpus']} CPUs; transformers {env['torch_threads']} threads, "
        f"the service's target {env['target_threads']}. specd-generate: the request "
        "`specd generate` sends to the embedded service it starts (started once), timed "
        "from request to final chunk, prefill included; x hf-plain: paired ratio of tok/s "
        "to transformers plain generate in the same repeat.",
    ]
    lines += forward_markdown(report) + threads_markdown(report)
    lines += ["", "| workload | system | tok/s | ms/token | x hf-plain | forward calls "
              "| acceptance length |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in report["summary"]:
        lines.append(_summary_cells(row))
    ident = report["identity"]
    lines.append("")
    lines += _identity_lines(ident, f"identical to transformers plain in all "
                             f"{ident['compared_runs']} runs.", "hf-plain", lengths=False)
    if not report["prompt_tokens"]["identical"]:
        lines.append("Prompt lengths differ between the service and transformers on: "
                     + ", ".join(report["prompt_tokens"]["differ"]))
    return "\n".join(lines + _targets_markdown(report)) + "\n"


def _summary_cells(row: dict) -> str:
    """A summary row's markdown cells, workload through acceptance length."""
    return (f"| {row['workload']} | {row['system']} | {_fmt(row['tok_s'])} | "
            f"{_fmt(row['ms_per_token'])} | {_fmt(row['ratio_to_plain'], '.2f')} | "
            f"{_fmt(row['forward_calls'], '.0f')} | {_fmt(row['acceptance_length'], '.2f')} |")


def _identity_lines(ident: dict, identical: str, reference: str, lengths: bool) -> list[str]:
    """The report's greedy-identity lines: ``identical`` when every run matched, else each
    mismatch against the ``reference`` system (with both lengths when ``lengths``)."""
    if ident["identical"]:
        return [f"Greedy outputs: {identical}"]
    lines = [f"Greedy outputs: {len(ident['mismatches'])} of {ident['compared_runs']} "
             f"runs differ from {reference}:"]
    for m in ident["mismatches"]:
        line = (f"- {m['workload']}/{m['prompt_id']} {m['system']} repeat "
                f"{m['repeat']}: first difference at token {m['first_diff']}")
        if lengths:
            line += f" (lengths {m['reference_len']} vs {m['len']})"
        lines.append(line)
    return lines


def _fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The report as Markdown: the per-workload table, identity, overhead and targets."""
    cfg = report["config"]
    env = report["environment"]
    lines = [
        f"# specd bench ({env['time_utc']})",
        "",
        f"Model {cfg['model'] or 'SmolLM2-135M-Instruct (default)'}, greedy, "
        f"max_new_tokens={cfg['max_new_tokens']}, repeats={cfg['repeats']}, "
        f"torch {env['torch']} with {env['torch_threads']} threads on {env['cpus']} CPUs. "
        "tok/s: median over repeats, prefill included; ms/token: decode only; "
        "x plain: paired ratio of tok/s to specd-plain in the same repeat.",
        "",
        "| workload | system | tok/s | ms/token | x plain | forward calls | acceptance length "
        "| accept rate per position |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["summary"]:
        per_pos = row["accept_rate_per_position"]
        per_pos = "-" if not per_pos else " ".join(f"{r:.2f}" for r in per_pos[:10]) + (
            " ..." if len(per_pos) > 10 else "")
        lines.append(f"{_summary_cells(row)} {per_pos} |")
    ident = report["identity"]
    lines.append("")
    lines += _identity_lines(ident, f"identical across all systems and repeats "
                             f"({ident['compared_runs']} runs).", "specd-plain", lengths=True)
    overhead = report.get("overhead")
    if overhead is not None:
        lines.append(
            f"Plain-decode overhead: specd-plain {overhead['plain_ms_per_token']:.1f} ms/token "
            f"vs bare forward {overhead['bare_ms_per_token']:.1f} ms/token: "
            f"{100 * overhead['overhead']:+.1f}% (wall time); in process CPU time "
            f"{overhead['plain_cpu_ms_per_token']:.1f} vs "
            f"{overhead['bare_cpu_ms_per_token']:.1f} ms/token: "
            f"{100 * overhead['cpu_overhead']:+.1f}%.")
    lines += forward_markdown(report) + _targets_markdown(report)
    return "\n".join(lines) + "\n"


def write_plots(report: dict, out: Path) -> list[Path]:
    """``tok_s.png`` (tok/s bars per workload and system) and ``accept_per_position.png``
    (accept rate by draft position for the drafting specd systems).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'specd[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    workloads = list(dict.fromkeys(r["workload"] for r in summary))
    systems = list(dict.fromkeys(r["system"] for r in summary))
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(workloads)), 4.2))
    for j, system in enumerate(systems):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            row = next((r for r in summary if r["workload"] == w and r["system"] == system),
                       None)
            if row is not None and row["tok_s"] is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(row["tok_s"])
        ax.bar(xs, ys, width, label=system)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("tokens / second (median)")
    ax.set_title(f"specd bench: greedy, {report['config']['max_new_tokens']} new tokens")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    paths = [out / "tok_s.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for row in summary:
        rates = row["accept_rate_per_position"]
        if rates:
            ax.plot(range(len(rates)), rates, marker="o", markersize=3,
                    label=f"{row['workload']} / {row['system']}")
    ax.set_xlabel("draft position (0 = first after the anchor)")
    ax.set_ylabel("accept rate, conditional on reaching it")
    ax.set_ylim(0, 1.05)
    ax.set_title("per-position accept rate")
    if ax.lines:
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    paths.append(out / "accept_per_position.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def write_report(report: dict, out: str | Path, plots: bool = True) -> list[Path]:
    """Writes ``bench.json``, ``bench.md`` and (``plots``) the PNGs into ``out`` (created).

    Returns:
        The written paths.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {**report, "targets": check_targets(report)} if "summary" in report else report
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    if report.get("mode") == "default-path":
        paths[1].write_text(default_path_markdown(report))
    else:
        paths[1].write_text(markdown(report) if "summary" in report
                            else service_markdown(report))
    if plots and "summary" in report:
        paths += write_plots(report, out)
    return paths


def service_markdown(report: dict) -> str:
    """A ``--service`` report as Markdown: one row per workload, mode and concurrency."""
    cfg = report["config"]
    lines = [
        f"# specd bench --service {cfg['service']} ({report['time_utc']})",
        "",
        f"Greedy, max_new_tokens={cfg['max_new_tokens']}; each level runs that many concurrent "
        "streams over the workload's prompts. Latency per token: gap between streamed chunks "
        "divided by the chunk's tokens. Draft wait: time a step waited for drafts before its "
        "verify (the serial step's whole Propose); run-ahead: steps that used / could not use "
        "the block drafted while the previous one was verified; target busy: the replicas' "
        "compute time over the time they had requests (since start).",
        "",
        "| workload | speculation | streams | aggregate tok/s | p50 ms/token | p95 ms/token "
        "| p50 first token s | draft wait ms/step | run-ahead hits / misses | target busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["levels"]:
        hits, misses = row.get("runahead_hits"), row.get("runahead_misses")
        runahead = "-" if hits is None else f"{hits:.0f} / {misses:.0f}"
        lines.append(
            f"| {row['workload']} | {'on' if row['speculation'] else 'off'} | {row['streams']} "
            f"| {row['tok_s']:.1f} | {_fmt(row['p50_ms_per_token'])} | "
            f"{_fmt(row['p95_ms_per_token'])} | {_fmt(row['p50_first_token_s'], '.2f')} | "
            f"{_fmt(row.get('draft_wait_ms_per_step'), '.2f')} | {runahead} | "
            f"{_fmt(row.get('target_busy_fraction'), '.2f')} |")
    ident = report["identity"]
    lines.append("")
    lines.append("Greedy outputs: " + (
        f"identical for every prompt at every level ({ident['compared_runs']} streams)."
        if ident["identical"] else
        f"{len(ident['mismatches'])} streams differ: " + "; ".join(
            f"{m['workload']}/{m['prompt_id']} streams={m['streams']}" for m in
            ident["mismatches"])))
    return "\n".join(lines) + "\n"
