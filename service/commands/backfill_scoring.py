"""`nobackfill backfill curve|cascade`: score a migration offline, exactly, on a test folder (no segment touched).

Registered on the backfill group by commands/backfill.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from service.commands import render
from service.vocabulary import Merge

# Both commands score on the same kind of folder: the new model's targets are what a moved item is searched by.
TEST_DIR = typer.Argument(..., help="Test folder with old AND new targets (new_target.npy).", metavar="TEST_DIR")


def curve(
    profile_dir: Path = typer.Argument(
        ..., help="Compat profile folder (its calibration merges the two lists).", metavar="PROFILE_DIR"
    ),
    test_dir: Path = TEST_DIR,
    fractions: str = typer.Option("0,0.1,0.25,0.5,0.75,1", "--fractions", help="Moved shares to score."),
    merge: Merge = typer.Option(Merge.calibrated, "--merge", help="calibrated, raw or rrf (compare them)."),
    order: str = typer.Option("random", "--order", help="random, or hot (Zipf traffic's hit counts first)."),
    zipf: float | None = typer.Option(
        None, "--zipf", min=0.0, help="Weigh queries by Zipf(s) popularity, as traffic would (e.g. 1.1)."
    ),
    traffic: int = typer.Option(10_000, "--traffic", min=1, help="--order hot: sampled queries whose hits count."),
    query_modality: str | None = typer.Option(None, help="Modality whose weights to use (default: the only one)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the move order, the Zipf ranks and the bootstrap."),
    plot: Path | None = typer.Option(None, "--plot", help="Write R@1 and R@10 against the moved share as a PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Quality as items move: hybrid R@1 / R@10 with bootstrap intervals at each moved share (offline, exact)."""
    from service.scoring.migration_curve import score_curve

    result = score_curve(
        profile_dir,
        test_dir,
        [float(f) for f in fractions.split(",") if f.strip()],
        merge=merge,
        order=order,
        zipf=zipf,
        traffic=traffic,
        modality=query_modality,
        seed=seed,
    )
    if plot is not None:
        from service.scoring.migration_curve import plot_curves

        plot.write_bytes(plot_curves({f"{order}, {merge}": result["rows"]}, result["title"]))
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.table import Table

    table = Table(title=result["title"], caption=result["caption"])
    columns = ("moved", "R@1", "95 % interval", "R@10", "95 % interval", "share of the gain (R@1)", "negative flips")
    for column in columns:
        table.add_column(column, justify="right")
    for row, share in zip(result["rows"], result["gain_share"], strict=True):
        table.add_row(
            f"{row['fraction']:.0%}",
            *_recall_cells(row),
            f"{share:.2f}",
            "{:.2%} [{:.2%}, {:.2%}]".format(row["negative_flips@1"], *row["flips_ci"]),
        )
    render.console().print(table)


def cascade(
    profile_dir: Path = typer.Argument(
        ..., help="Compat profile folder (its head's query is stage 1).", metavar="PROFILE_DIR"
    ),
    test_dir: Path = TEST_DIR,
    candidates: str = typer.Option("10,20,50,100", "--candidates", help="Stage-1 candidates N to score, rising."),
    budget: int | None = typer.Option(
        None, "--budget", min=0, help="Re-rank only the first B candidates (new encodes per query; default: all N)."
    ),
    modality: str | None = typer.Option(None, "--modality", help="Modality whose weights to use (default: the first)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Re-rank cascade: R@1 / R@10 of the top N old hits re-ranked by the new model (offline, exact)."""
    from service.errors import InputError
    from service.scoring.rerank_eval import score_cascade

    try:
        sizes = [int(c) for c in candidates.split(",") if c.strip()]
    except ValueError:
        raise InputError(f"--candidates must be integers separated by commas, got {candidates!r}") from None
    result = score_cascade(profile_dir, test_dir, sizes, budget=budget, modality=modality, seed=seed)
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.table import Table

    table = Table(title=result["title"], caption=f"{result['caption']}; {result['seconds']} s")
    for column in ("search", "N", "B", "stage-1 recall@N", "R@1", "95 % interval", "R@10", "95 % interval"):
        table.add_column(column, justify="right")
    references = (("compatible alone (stage 1)", result["compatible"]), ("re-indexed (ceiling)", result["reindexed"]))
    for name, ref in references:
        table.add_row(name, "", "", "", *_recall_cells(ref))
    for row in result["rows"]:
        stage1 = "{:.4f} [{:.4f}, {:.4f}]".format(row["stage1_recall"], *row["stage1_ci"])
        table.add_row("cascade", str(row["candidates"]), str(row["budget"]), stage1, *_recall_cells(row))
    render.console().print(table)


def _recall_cells(row: dict[str, Any]) -> list[str]:
    """R@1, its interval, R@10, its interval, as table cells."""
    return [
        f"{row['recall@1']:.4f}",
        "[{:.4f}, {:.4f}]".format(*row["ci@1"]),
        f"{row['recall@10']:.4f}",
        "[{:.4f}, {:.4f}]".format(*row["ci@10"]),
    ]
