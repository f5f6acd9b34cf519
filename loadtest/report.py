"""Turn a load-test run (Locust CSVs, /metrics scrapes, hit@10) into loadtest/report.md and PNG plots.

python loadtest/report.py --results loadtest/results --out loadtest/report.md
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def read_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a Locust CSV."""
    with path.open() as handle:
        return list(csv.DictReader(handle))


def cache_counts(text: str) -> tuple[float, float]:
    """(hits, misses) from one /metrics scrape."""
    hits = misses = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "nobackfill_cache_events":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                event = sample.labels.get("event")
                hits += sample.value if event == "hit" else 0.0
                misses += sample.value if event == "miss" else 0.0
    return hits, misses


def histogram_means(text: str, family_name: str, label: str) -> dict[str, float]:
    """Mean of one histogram per value of `label` (sum / count) from one scrape."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for sample in family.samples:
            key = sample.labels.get(label, "?")
            if sample.name.endswith("_sum"):
                sums[key] = sample.value
            elif sample.name.endswith("_count"):
                counts[key] = sample.value
    return {key: sums[key] / counts[key] for key in sums if counts.get(key)}


def stage_means_ms(text: str) -> dict[str, float]:
    """Mean time per stage (ms) from the stage histogram of one scrape."""
    means = histogram_means(text, "nobackfill_stage_duration_seconds", "stage")
    return {stage: 1000 * mean for stage, mean in means.items()}


def mean_batch_sizes(text: str) -> dict[str, float]:
    """Mean encoder batch size per encoder (old / new) from the batch-size histogram of one scrape."""
    return histogram_means(text, "nobackfill_encoder_batch_size", "encoder")


def read_pairs(path: Path) -> dict[str, list[float]]:
    """`name v1 v2 ...` lines (a /proc/stat line, run.sh's CPU snapshots, /usr/bin/time's output) as a dict."""
    out: dict[str, list[float]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.startswith("Command "):  # /usr/bin/time's "Command exited with non-zero status 1": Locust saw failures
            continue
        name, *values = line.split()
        if values:
            out[name] = [float(v) for v in values]
    return out


def cpu_lines(results: Path) -> list[str]:
    """Cores used in the Locust run by the box, the service, its encoder processes and Locust (when recorded)."""
    start, end = read_pairs(results / "cpu-start.txt"), read_pairs(results / "cpu-end.txt")
    if "time" not in start or "time" not in end:
        return []
    wall = end["time"][0] - start["time"][0]
    cores = end.get("cores", [1.0])[0]
    ticks = end.get("ticks_per_s", [100.0])[0]
    lines = [f"CPU over the {wall:.0f} s Locust run ({cores:.0f} cores on the box):", ""]
    if "cpu" in start and "cpu" in end:
        deltas = [b - a for a, b in zip(start["cpu"], end["cpu"], strict=False)]
        total = sum(deltas) or 1.0
        share = [d / total for d in [*deltas, 0.0, 0.0, 0.0, 0.0][:8]]  # user nice system idle iowait irq softirq steal
        busy = 1 - share[3] - share[4]  # steal counts as busy, as it always did here: the box wanted the CPU
        lines.append(
            f"- whole box: {busy * cores:.2f} cores busy ({100 * busy:.0f} %); "
            f"iowait {100 * share[4]:.1f} %, stolen by the hypervisor {100 * share[7]:.1f} %"
        )
    if "service" in start and "service" in end:
        used = (sum(end["service"]) - sum(start["service"])) / ticks
        lines.append(f"- service process: {used / wall:.2f} cores ({used:.0f} CPU-s)")
    if "encoder_processes" in start and "encoder_processes" in end:
        used = (end["encoder_processes"][0] - start["encoder_processes"][0]) / ticks
        lines.append(f"- its encoder processes (isolation: process): {used / wall:.2f} cores ({used:.0f} CPU-s)")
    if "major_faults" in start and "major_faults" in end:
        faults = end["major_faults"][0] - start["major_faults"][0]
        lines.append(f"- major page faults (pages read back from disk), service and encoder processes: {faults:.0f}")
    if "io_stall_us" in start and "io_stall_us" in end:
        stalled = (end["io_stall_us"][0] - start["io_stall_us"][0]) / 1e6
        lines.append(f"- some task waited on IO {100 * stalled / wall:.1f} % of the time (/proc/pressure/io)")
    timed = read_pairs(results / "locust-time.txt")
    if "locust_user" in timed:
        used = timed["locust_user"][0] + timed["locust_sys"][0]
        span = timed["locust_wall"][0]
        lines.append(f"- Locust: {used / span:.2f} cores ({used:.0f} CPU-s over its {span:.0f} s, start-up included)")
    return [*lines, ""]


def scrapes(path: Path) -> list[tuple[float, str]]:
    """(unix time, exposition text) for each periodic scrape."""
    if not path.exists():
        return []
    out: list[tuple[float, str]] = []
    for chunk in path.read_text().split("### ")[1:]:
        stamp, _, body = chunk.partition("\n")
        if body.strip():
            out.append((float(stamp), body))
    return out


def plot_history(history: list[dict[str, str]], results: Path) -> list[str]:
    """Latency percentiles and throughput over time; returns the PNG names."""
    rows = [r for r in history if r.get("Name") == "Aggregated" and r.get("50%", "N/A") != "N/A"]
    if not rows:
        return []
    start = float(rows[0]["Timestamp"])
    t = [float(r["Timestamp"]) - start for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    for pct in ("50%", "95%", "99%"):
        ax.plot(t, [float(r[pct]) for r in rows], label=f"p{pct.rstrip('%')}")
    ax.set(xlabel="seconds", ylabel="latency (ms)", title="Latency percentiles (Locust rolling window)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results / "latency.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [float(r["Requests/s"]) for r in rows], label="requests/s")
    ax.plot(t, [float(r["Failures/s"]) for r in rows], label="failures/s")
    ax.set(xlabel="seconds", ylabel="per second", title="Throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results / "throughput.png")
    plt.close("all")
    return ["latency.png", "throughput.png"]


def plot_cache(series: list[tuple[float, str]], results: Path) -> str | None:
    """Cache hit ratio between consecutive scrapes."""
    points = [(stamp, *cache_counts(text)) for stamp, text in series]
    xs, ys = [], []
    for (_, h0, m0), (t1, h1, m1) in zip(points, points[1:], strict=False):
        looked_up = (h1 - h0) + (m1 - m0)
        if looked_up > 0:
            xs.append(t1 - points[0][0])
            ys.append((h1 - h0) / looked_up)
    if not xs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, ys)
    ax.set(xlabel="seconds", ylabel="hit ratio", ylim=(0, 1), title="Old-embedding cache hit ratio")
    fig.tight_layout()
    fig.savefig(results / "cache_hit_ratio.png")
    plt.close(fig)
    return "cache_hit_ratio.png"


def main() -> None:
    """Write the report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=Path, default=Path("loadtest/results"))
    parser.add_argument("--out", type=Path, default=Path("loadtest/report.md"))
    args = parser.parse_args()
    results: Path = args.results
    stats = read_csv(results / "locust_stats.csv")
    history_path = results / "locust_stats_history.csv"
    history = read_csv(history_path) if history_path.exists() else []
    final_path = results / "metrics-final.txt"
    final = final_path.read_text() if final_path.exists() else ""
    hits_path = results / "hit_at_10.json"
    hit_report = json.loads(hits_path.read_text()) if hits_path.exists() else {}
    images = plot_history(history, results)
    cache_png = plot_cache(scrapes(results / "metrics.txt"), results)
    hits, misses = cache_counts(final)
    lines = [
        "# Load test report",
        "",
        "| name | requests | failures | req/s | p50 ms | p95 ms | p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in stats:
        lines.append(
            f"| {row['Name']} | {row['Request Count']} | {row['Failure Count']} | {float(row['Requests/s']):.1f} "
            f"| {row['50%']} | {row['95%']} | {row['99%']} |"
        )
    ratio = f"{hits / (hits + misses):.3f}" if hits + misses else "n/a"
    lines += ["", f"Cache hit ratio (service counters): {ratio} ({hits:.0f} hits, {misses:.0f} misses)", ""]
    lines += ["| mode | queries | hit@10 |", "|---|---|---|"]
    lines += [f"| {mode} | {r['queries']} | {r['hit@10']:.3f} |" for mode, r in hit_report.items()]
    lines += ["", "Mean time per stage (ms, service histograms):", ""]
    lines += [f"- {stage}: {ms:.3f}" for stage, ms in sorted(stage_means_ms(final).items())]
    batches = mean_batch_sizes(final)
    lines += ["", "Mean encoder batch size: " + ", ".join(f"{e} {b:.2f}" for e, b in sorted(batches.items()))]
    lines += ["", *cpu_lines(results)]
    pngs = [name for name in [*images, cache_png] if name]
    lines += [""] + [f"![{name}]({os.path.relpath(results / name, args.out.parent)})" for name in pngs]
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
