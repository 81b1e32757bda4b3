"""The tables and plots of `specd bench serve` runs (`specd_tools.bench.serve` records):
vLLM's result block per run, a per-category table, a sweep table, latency CDFs and the sweep
plot (matplotlib, the optional ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .serve import LATENCY_METRICS, PERCENTILES

#: The summary rows: (label, metric key, format).
_TABLE = (
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Finished answers checked (schema)", "schema_checked", "{:d}"),
    ("... matching their schema", "schema_valid", "{:d}"),
    ("Benchmark duration (s)", "duration", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s)", "request_goodput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Target forward calls (specd)", "forward_calls", "{:d}"),
    ("Acceptance length (specd)", "acceptance_length", "{:.2f}"),
)
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency (per chunk)", "e2el": "End-to-end Latency"}


def _latency_rows(name: str) -> list[tuple[str, str, str]]:
    up = name.upper()
    rows = [(f"Mean {up} (ms)", f"mean_{name}_ms", "{:.2f}"),
            (f"Median {up} (ms)", f"median_{name}_ms", "{:.2f}"),
            (f"Std {up} (ms)", f"std_{name}_ms", "{:.2f}")]
    return rows + [(f"P{p} {up} (ms)", f"p{p}_{name}_ms", "{:.2f}") for p in PERCENTILES]


def format_run(record: dict[str, Any]) -> str:
    """The vLLM-style result block of one run, then its per-category table."""
    width = 50
    lines = [f" {record['label']}, {point_label(record)} ".center(width, "=")]

    def rows(spec) -> None:
        for label, key, fmt in spec:
            if record.get(key) is not None:
                lines.append(f"{label + ':':<40}{fmt.format(record[key]):>10}")

    rows(_TABLE)
    for name in LATENCY_METRICS:
        lines.append(f"{_TITLES[name]:-^{width}}")
        rows(_latency_rows(name))
    lines.append("=" * width)
    cats = record.get("per_category") or {}
    if cats:
        lines.append(category_table(cats))
    sources = sorted(set(record.get("token_sources") or ()) - {"usage"})
    if sources:
        lines.append(f"note: token counts from the {' and '.join(sources)} for some requests "
                     "(the server sent no usage)")
    return "\n".join(lines)


def category_table(cats: dict[str, dict[str, Any]]) -> str:
    """One row per category: completed, output tokens, median TTFT/TPOT/ITL/E2EL in ms, and
    the acceptance length when a specd server sent its counters."""
    spec = any(m.get("acceptance_length") is not None for m in cats.values())
    head = (f"{'category':<12}{'done':>6}{'out tok':>9}{'p50 TTFT':>10}{'p50 TPOT':>10}"
            f"{'p50 ITL':>9}{'p50 E2EL':>10}" + (f"{'acc len':>9}" if spec else ""))
    lines = ["per category (ms):", head]
    for name, m in cats.items():
        al = m.get("acceptance_length")
        lines.append(f"{name[:12]:<12}{m['completed']:>6d}{m['total_output_tokens']:>9d}"
                     f"{m['median_ttft_ms']:>10.1f}{m['median_tpot_ms']:>10.1f}"
                     f"{m['median_itl_ms']:>9.1f}{m['median_e2el_ms']:>10.1f}"
                     + ((f"{al:>9.2f}" if al is not None else f"{'-':>9}") if spec else ""))
    return "\n".join(lines)


def point_label(record: dict[str, Any]) -> str:
    """``"rate R"`` or ``"rate R, C in flight"``: which load a run record ran at."""
    c = record.get("max_concurrency")
    return f"rate {record['request_rate']}" + (f", {c} in flight" if c else "")


def sweep_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per run: rate, concurrency cap, req/s, output tok/s, p50/p99 TTFT, p50 TPOT,
    p50 ITL (ms)."""
    head = (f"{'server':<8}{'rate':>6}{'conc':>6}{'req/s':>8}{'out tok/s':>11}{'p50 TTFT':>10}"
            f"{'p99 TTFT':>10}{'p50 TPOT':>10}{'p50 ITL':>9}")
    lines = [head]
    for r in records:
        lines.append(f"{r['label'][:8]:<8}{r['request_rate']!s:>6}"
                     f"{r['max_concurrency'] or '-'!s:>6}"
                     f"{r['request_throughput']:>8.2f}{r['output_throughput']:>11.2f}"
                     f"{r['median_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>10.1f}"
                     f"{r['median_tpot_ms']:>10.1f}{r['median_itl_ms']:>9.1f}")
    return "\n".join(lines)


def _short_point(record: dict[str, Any]) -> str:
    c = record.get("max_concurrency")
    return f"{record['request_rate']}" + (f" c={c}" if c else "")


def write_plots(records: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """``latency_cdf.png`` (the CDF of TTFT, TPOT, ITL and E2EL, one line per run) and, when
    the runs span more than one load (request rate, concurrency cap), ``sweep.png`` (output
    throughput and p99 TTFT against it, one line per server label) into ``out_dir``.

    Raises:
        ValueError: matplotlib is missing (names ``--plot-dir``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot-dir needs matplotlib: pip install 'specd[bench]'") from None
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name in zip(axes.flat, LATENCY_METRICS, strict=True):
        for r in records:
            values = {"ttft": [t for t, e in zip(r["ttfts"], r["errors"], strict=True) if not e],
                      "tpot": [t for t in r["tpots"] if t is not None],
                      "itl": [g for gaps in r["itls"] for g in gaps],
                      "e2el": [t for t, e in zip(r["e2els"], r["errors"], strict=True)
                               if not e]}[name]
            if not values:
                continue
            ms = np.sort(np.asarray(values) * 1000.0)
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post",
                    label=f"{r['label']} {point_label(r)}")
        ax.set_title(_TITLES[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("gaps" if name == "itl" else "requests"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [out / "latency_cdf.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    points = list(dict.fromkeys(_short_point(r) for r in records))
    if len(points) > 1:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for label in dict.fromkeys(r["label"] for r in records):
            mine = [r for r in records if r["label"] == label]
            xs = [points.index(_short_point(r)) for r in mine]
            a1.plot(xs, [r["output_throughput"] for r in mine], marker="o", label=label)
            a2.plot(xs, [r["p99_ttft_ms"] for r in mine], marker="o", label=label)
        for ax, title in ((a1, "output throughput (tok/s)"), (a2, "p99 TTFT (ms)")):
            ax.set_xticks(range(len(points)), points)
            ax.set_xlabel("request rate (req/s)" + (
                ", max concurrency" if any(r["max_concurrency"] for r in records) else ""))
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        paths.append(out / "sweep.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
