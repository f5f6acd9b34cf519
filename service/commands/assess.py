"""`nobackfill assess`: the upgrade decision (service/scoring/assess.py) as a table, JSON, or a markdown report."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from service.scoring.thresholds import MIN_GAIN, MIN_RETENTION

SAMPLE = 256  # inputs timed to measure the new encoder's rate


def assess(
    source: Path = typer.Argument(
        ..., help="A profile folder, or a support folder to fit one on (default options).", metavar="SOURCE"
    ),
    test_dir: Path | None = typer.Argument(
        None,
        help="Labelled test folder with new_target.npy (default: the support folder itself, in-sample).",
        metavar="TEST_DIR",
    ),
    gallery_items: int | None = typer.Option(None, "--gallery-items", min=1, help="Items in the gallery to re-encode."),
    rate: float | None = typer.Option(None, "--rate", min=0.0, help="The new encoder's items per second, if known."),
    backend: str | None = typer.Option(None, "--backend", help="Measure the rate: the new model's backend."),
    path: str | None = typer.Option(None, "--path", help="The new model's folder (real backends)."),
    min_gain: float = typer.Option(MIN_GAIN, "--min-gain", help="R@10 gain under which no upgrade is needed."),
    min_retention: float = typer.Option(MIN_RETENTION, "--min-retention", help="ARR@10 at which the bridge suffices."),
    query_modality: str | None = typer.Option(None, help="Modality to score (default: the profile's only one)."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as one JSON object."),
    report: Path | None = typer.Option(None, "--report", help="Also write a markdown report (and its plot) here."),
) -> None:
    """Is the upgrade worth it, does the bridge suffice, backfill how much, or re-index: one verdict and why."""
    from service.compat.io import load_split
    from service.compat.profile import load_profile
    from service.errors import InputError
    from service.scoring.assess import assess as run_assess
    from service.scoring.assess import backfill_cost, expected_curve

    with tempfile.TemporaryDirectory(prefix="nobackfill-assess-") as scratch:
        profile_dir, in_sample = _profile_dir(source, Path(scratch))
        if test_dir is None and not in_sample:
            raise InputError(f"{source} is a profile: give TEST_DIR, a labelled test folder with new_target.npy")
        test_dir = test_dir or source
        profile = load_profile(profile_dir)
        modality = query_modality or (sorted(profile.alphas) or ["text"])[0]
        test = load_split(test_dir, old_dim=profile.old_dim, new_dim=profile.new_dim)
        result = run_assess(profile, test, modality, min_gain=min_gain, min_retention=min_retention)
        result["in_sample"] = test_dir == source and in_sample
        result["curve"] = expected_curve(profile_dir, test_dir, modality)
    if backend is not None:
        rate = _measured_rate(backend, path)
    if gallery_items is not None and rate is not None:
        result["backfill_cost"] = backfill_cost(gallery_items, rate)
    for line in _warnings(result):
        typer.echo(f"warning: {line}", err=True)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for line in _lines(result):
            typer.echo(line)
    if report is not None:
        _write_report(report, result)


def _profile_dir(source: Path, scratch: Path) -> tuple[Path, bool]:
    """The profile folder to assess, fitting one on `source` when it is a support folder; and whether it was."""
    from service.compat.fit_options import FitOptions
    from service.compat.fitting import fit_profile
    from service.compat.profile import save_profile

    if (source / "profile.json").is_file():
        return source, False
    outcome = fit_profile({"text": source}, FitOptions())
    save_profile(outcome.profile, scratch / "profile")
    return scratch / "profile", True


def _measured_rate(backend: str, path: str | None) -> float:
    """Items per second of the new model here, over SAMPLE short inputs in batches of 64 (after one warm batch)."""
    from service.encoders.registry import create_encoder
    from service.encoders.synthetic import format_item
    from service.settings import EncoderSettings
    from service.vocabulary import Modality, Role

    encoder = create_encoder(EncoderSettings(backend=backend, path=path), Role.new)
    texts = [format_item(i) for i in range(SAMPLE)]
    encoder.encode(texts[:64], Modality.text)
    started = time.perf_counter()
    for start in range(0, SAMPLE, 64):
        encoder.encode(texts[start : start + 64], Modality.text)
    return SAMPLE / (time.perf_counter() - started)


def _warnings(result: dict[str, Any]) -> list[str]:
    """What the reader must know before trusting the verdict."""
    lines = [result["warning"]] if result["warning"] else []
    if result["in_sample"]:
        lines.append("no TEST_DIR: scored on the support set the profile was fitted on (in-sample: optimistic)")
    return lines


def _lines(result: dict[str, Any]) -> list[str]:
    """The verdict, why, and the figures, as terminal lines."""
    from service.compat.uncertainty import describe

    bridge, kept, kept_ndcg = result["bridge"], result["bridge"]["arr@10"], result["bridge"]["ndcg_retention@10"]
    limits = result["thresholds"]
    lines = [
        f"verdict: {result['verdict'].upper()}",
        f"  why: {result['why']}",
        f"  profile {result['profile_id']} ({result['head']}) on {result['test']} ({result['queries']} queries)",
        f"  new->new vs old->old: R@10 {describe(result['gain'])}, R@1 {describe(result['gain@1'])} points (95 %)",
        f"  bridge vs old->old: R@10 {describe(bridge['vs_old']['recall@10'])}, "
        f"R@1 {describe(bridge['vs_old']['recall@1'])} points; {bridge['compatible']} at R@10, "
        f"{bridge['compatible@1']} at R@1",
        "  bridge retention: "
        + ", ".join(f"{name} {_ratio(part)}" for name, part in (("ARR@10", kept), ("nDCG@10", kept_ndcg))),
        f"  thresholds: gain under {limits['min_gain']:.0%} (R@10 and R@1) = no upgrade; "
        f"both retentions from {limits['min_retention']:.0%} = bridge suffices",
    ]
    if result["curve"]:
        moved = ", ".join(
            f"{r['fraction']:.0%}: R@1 {r['recall@1']:.3f} / R@10 {r['recall@10']:.3f}" for r in result["curve"]
        )
        lines.append(f"  hybrid search as items move (random order): {moved}")
    if "backfill_cost" in result:
        cost = result["backfill_cost"]
        seconds = cost["seconds"]
        took = (
            f"{seconds / 3600:.1f} h"
            if seconds >= 3600
            else f"{seconds / 60:.1f} min"
            if seconds >= 60
            else f"{seconds:.1f} s"
        )
        lines.append(f"  full backfill: {cost['items']:,} items at {cost['items_per_s']:,.0f} items/s = {took}")
    return lines


def _ratio(part: dict[str, float] | None) -> str:
    """A retention and its interval, e.g. '0.816 [0.784, 0.847]'."""
    return "-" if part is None else f"{part['value']:.3f} [{part['low']:.3f}, {part['high']:.3f}]"


def _write_report(out: Path, result: dict[str, Any]) -> None:
    """A short markdown report with the figures, and the migration curve's plot beside it when there is one."""
    from service.scoring.migration_curve import plot_curves

    body = ["# Upgrade assessment", "", *(f"    {line}" for line in _lines(result)), ""]
    if result["curve"]:
        plot = out.with_suffix(".png")
        plot.write_bytes(plot_curves({"hybrid, random order": result["curve"]}, result["verdict"]))
        body += [f"![hybrid search as items move]({plot.name})", ""]
    body += ["```json", json.dumps(result, indent=2), "```", ""]
    out.write_text("\n".join(body), encoding="utf-8")
