"""Writing benchmark results: JSON (everything), a markdown table, PNG plots (matplotlib)."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from dataclasses import asdict
from pathlib import Path

from omnibus.bench.stats import PERCENTILES, RequestResult

LATENCY_ROWS = (
    ("TTFT", "ttft_ms"),
    ("TPOT", "tpot_ms"),
    ("ITL", "itl_ms"),
    ("E2E latency", "e2e_ms"),
)


def machine() -> str:
    """This host's CPU model and core count (benchmark numbers move with the VM they ran on)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block is enough
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    if "model" in info:
        name += f" (family {info.get('cpu family', '?')}, model {info['model']})"
    return f"{name}, {os.cpu_count()} cores"


def fmt(value: float | int | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.{digits}f}"


def summary_markdown(summary: dict, title: str = "Serving benchmark", setup: str = "") -> str:
    """One run's metrics as a markdown document."""
    s = summary
    failures = ", ".join(f"{code}: {n}" for code, n in s["failures_by_code"].items()) or "none"
    lines = [f"# {title}", ""]
    if setup:
        lines += [setup, ""]
    lines += [
        "| metric | value |",
        "|---|---:|",
        f"| requests (completed / sent) | {s['completed']} / {s['requests']} |",
        f"| duration | {fmt(s['duration_s'], 2)} s |",
        f"| request throughput | {fmt(s['request_throughput'], 2)} req/s |",
        f"| output token throughput | {fmt(s['output_throughput'])} tok/s |",
        f"| total token throughput (prompt + output) | {fmt(s['total_token_throughput'])} tok/s |",
        f"| goodput ({s['slo']}) | {fmt(s['goodput'], 2)} req/s ({s['good_requests']} requests) |",
        f"| failures by status code | {failures} |",
        "",
        "| latency (ms) | mean | " + " | ".join(f"p{q}" for q in PERCENTILES) + " |",
        "|---|---:|" + "---:|" * len(PERCENTILES),
    ]
    for name, key in LATENCY_ROWS:
        d = s[key]
        lines.append(
            f"| {name} | {fmt(d['mean'])} | "
            + " | ".join(fmt(d[f"p{q}"]) for q in PERCENTILES)
            + " |"
        )
    return "\n".join(lines) + "\n"


def engine_markdown(engine: dict) -> str:
    """The engine-side view of a run (EngineMonitor.summary())."""
    if not engine:
        return ""
    rows = [
        ("engine steps", engine.get("counters", {}).get("num_steps")),
        ("mean running sequences", engine.get("mean_running")),
        ("mean waiting sequences", engine.get("mean_waiting")),
        ("busy fraction (≥ 1 running)", engine.get("busy_fraction")),
        ("idle with work waiting (fraction of time)", engine.get("idle_with_work_fraction")),
        ("mean KV tokens reserved", engine.get("mean_kv_tokens_reserved")),
        ("compute utilization (useful tokens ÷ slots stepped)", engine.get("compute_utilization")),
        ("KV efficiency (tokens stored ÷ reserved)", engine.get("kv_efficiency")),
    ]
    lines = ["| engine | value |", "|---|---:|"]
    lines += [f"| {name} | {fmt(v, 3) if isinstance(v, float) else fmt(v)} |" for name, v in rows]
    return "\n".join(lines) + "\n"


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """median, and min–max when there are several values."""
    med = fmt.format(statistics.median(values))
    if len(values) < 2:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def replace_section(text: str, start: str, section: str, end: str | None = None) -> str:
    """`text` with its part from the marker `start` up to the marker `end` (None: to the
    end) replaced by `section`, which begins with `start`; where `text` has no `start`,
    `section` goes in before `end` (or at the end). A benchmark that measured one part of
    a report rewrites that part and keeps the rest as it was."""
    begin = text.find(start)
    stop = text.find(end, max(begin, 0)) if end is not None else -1
    stop = len(text) if stop < 0 else stop
    head = text[: stop if begin < 0 else begin]
    if head and not head.endswith("\n\n"):
        head = head.rstrip("\n") + "\n\n"
    return head + section + text[stop:]


def write_keeping_reading(path: Path, report: str) -> None:
    """`report` into `path`, keeping the hand-written "## Reading" section a previous run's
    file has (a rerun replaces the measured tables only)."""
    previous = path.read_text() if path.is_file() else ""
    reading = previous[previous.index("## Reading"):] if "## Reading" in previous else ""
    path.write_text(report + ("\n" + reading if reading else ""))


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable, allow_nan=True) + "\n")


def results_payload(results: list[RequestResult]) -> list[dict]:
    return [asdict(r) for r in results]


def _jsonable(obj: object) -> object:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(results: list[RequestResult], path: Path, title: str = "") -> None:
    """Four panels: TTFT, TPOT and E2E distributions (CDFs), and E2E by send time."""
    plt = _pyplot()
    done = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        ("TTFT (ms)", [r.ttft for r in done]),
        ("TPOT (ms)", [r.tpot for r in done]),
        ("ITL (ms)", [g for r in done for g in r.itls]),
    )
    for ax, (label, values) in zip(axes.flat, panels):
        values = sorted(v * 1e3 for v in values if v is not None)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if label != "ITL (ms)" else "fraction of gaps")
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    ax.scatter([r.sent for r in done], [r.e2e * 1e3 for r in done], s=8)
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("E2E latency (ms)")
    ax.grid(alpha=0.3)
    fig.suptitle(title or "serving benchmark")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lines(
    series: dict[str, list[tuple[float, float]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logy: bool = False,
    annotate: dict[str, list[str]] | None = None,
    logx: bool = False,
) -> None:
    """One line per series of (x, y) points, optionally labelling each point."""
    plot_panels([Panel(series, xlabel, ylabel, title, logy, annotate, logx)], path)


class Panel:
    """One set of axes of `plot_panels`."""

    def __init__(
        self,
        series: dict[str, list[tuple[float, float]]],
        xlabel: str,
        ylabel: str,
        title: str = "",
        logy: bool = False,
        annotate: dict[str, list[str]] | None = None,
        logx: bool = False,
    ) -> None:
        self.series, self.xlabel, self.ylabel, self.title = series, xlabel, ylabel, title
        self.logy, self.logx, self.annotate = logy, logx, annotate or {}


def plot_panels(panels: list[Panel], path: Path, suptitle: str = "") -> None:
    """Panels side by side, one line per series, the same series names share colours."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name, points in panel.series.items():
            points = [(x, y) for x, y in points if y is not None and not math.isnan(y)]
            if not points:
                continue
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
            for (x, y), text in zip(points, panel.annotate.get(name, [])):
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if panel.logy:
            ax.set_yscale("log")
        if panel.logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(alpha=0.3)
        ax.legend()
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(
    labels: list[str],
    values: list[float],
    path: Path,
    *,
    ylabel: str,
    title: str,
    reference: float | None = None,
) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(labels, values)
    ax.bar_label(bars, labels=[f"{v:.2f}×" for v in values])
    if reference is not None:
        ax.axhline(reference, linestyle="--", color="grey")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
