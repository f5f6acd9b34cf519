"""Rendering of fit reports for `fit`, `eval` and `profile show`: rich tables, the fit plot and one-line summaries.

Heavy imports (rich, matplotlib) happen inside the functions so `nobackfill --help` stays fast.
"""

from __future__ import annotations

from typing import Any

from service.plots import png_of, pyplot


def model_name(backend: str, model_id: str) -> str:
    """`backend model_id`, or the id alone where it is the backend's own name (not "synthetic-new synthetic-new")."""
    return model_id if model_id == backend else f"{backend} {model_id}"


def fmt(x: Any) -> str:
    """Table cell text: 4 decimals for floats, '-' for missing."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


# The score a selection criterion reads off a curve row, and its standard error (see selection.py).
_SCORE_OF = {"r1": "recall@1", "mean": "mean@1-10", "mrr": "mrr@10"}
_SE_OF = {"recall@1": "se@1", "mean@1-10": "se_mean@1-10", "mrr@10": "se_mrr@10"}


def console() -> Any:
    """A rich console for the CLI's tables: the terminal's width, or 240 columns when piped (tables stay unwrapped)."""
    import sys

    from rich.console import Console

    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240)


def _criterion_score(report: dict[str, Any]) -> str:
    """The curve key the report's criterion ranks by (R@1 for reports made before criteria existed)."""
    return _SCORE_OF.get(str(report.get("criterion", "r1")).removesuffix("-1se"), "recall@1")


def _pm(row: dict[str, Any], key: str) -> str:
    """'0.5612 ±0.0040' when the row has a standard error for key, else the value alone."""
    se = row.get(_SE_OF.get(key, ""))
    return f"{row[key]:.4f}" if se is None else f"{row[key]:.4f} ±{se:.4f}"


def recall_table(report: dict[str, Any], title: str) -> Any:
    """Rich table of support Recall@1/5/10 (± standard error) per alpha for every curve, and the criterion's score."""
    from rich.table import Table

    curves = report["support_recall"]
    score = _criterion_score(report)
    extra = score != "recall@1" and all(score in rows[0] for rows in curves.values())
    table = Table(title=title, caption=report.get("criterion_text"))
    table.add_column("alpha", justify="right")
    for mode in curves:
        for k in (1, 5, 10):
            table.add_column(f"{mode} R@{k}", justify="right")
        if extra:
            table.add_column(f"{mode} {score}", justify="right")
    chosen = {mode: report["chosen"][mode]["alpha"] for mode in curves}
    for i, alpha in enumerate(report["alpha_grid"]):
        cells = [f"{alpha:.1f}"]
        for mode in curves:
            row = curves[mode][i]
            mark = "*" if chosen[mode] == alpha else ""
            cells += [_pm(row, "recall@1") + mark, f"{row['recall@5']:.4f}", f"{row['recall@10']:.4f}"]
            if extra:
                cells.append(_pm(row, score))
        table.add_row(*cells)
    return table


def plot_png(panels: list[tuple[dict[str, Any], str]], heading: str | None = None) -> bytes:
    """Per (report, title): support R@1 (and the criterion's score) vs alpha with standard-error bars, as PNG.

    Each panel shows what chose the weight: the band within one standard error of the best point of the
    first curve (the 1-s.e. rules pick inside it), and old->old (alpha 0: the old query unchanged) as a
    line; `heading` names the profile, its models and the verdict.
    """
    plt = pyplot()
    ncols = max(1 + (_criterion_score(rep) != "recall@1") for rep, _ in panels)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(6 * ncols, 4 * len(panels) + 0.6), dpi=100, squeeze=False)
    for row, (report, title) in zip(axes, panels, strict=True):
        score = _criterion_score(report)
        keys = ["recall@1"] + ([score] if score != "recall@1" else [])
        for ax in row[len(keys) :]:
            ax.set_visible(False)
        for ax, key in zip(row, keys, strict=False):
            for i, (mode, style) in enumerate(zip(report["support_recall"], ("o-", "s--", "^-."), strict=False)):
                rows = report["support_recall"][mode]
                se = [r.get(_SE_OF[key], 0.0) for r in rows]
                bars = ax.errorbar([r["alpha"] for r in rows], [r[key] for r in rows], yerr=se, fmt=style, capsize=3)
                color = bars.lines[0].get_color()
                best = report["chosen"][mode]
                ax.axvline(best["alpha"], linestyle=":", alpha=0.5, color=color)
                ax.plot([], [], style, color=color, label=f"{mode} (chosen {best['alpha']:.1f})")
                if i == 0:
                    _reference_lines(ax, rows, key, mode, color, report.get("new_to_new"))
            without = report.get("query_pairs", {}).get("curve_r1_without")
            if without and key == "recall@1":  # what the query pairs did: the same folds, R without them
                ax.plot(report["alpha_grid"], without, "x:", color="grey", label="slerp, R without query pairs")
            ax.set_xlabel("alpha (0 = old query, 1 = mapped new query)")
            ax.set_ylabel(f"support {key} ({report['selection']}), ± 1 s.e.")
            ax.set_title(f"{title}\n{report.get('criterion_text', 'arg-max of R@1')}", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    if heading:
        verdict = verdict_line(panels[0][0])
        heading = heading + ("\n" + verdict if verdict else "")
        fig.suptitle(heading, fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 0.94))
    return png_of(fig)


def _reference_lines(
    ax: Any, rows: list[dict[str, Any]], key: str, mode: str, color: Any, ceiling: dict[str, float] | None
) -> None:
    """The band within one s.e. of the curve's best point, old->old (its alpha-0 point) and, when the support
    has new targets, new->new (the re-indexed search on the same held-out rows) as lines."""
    best = max(rows, key=lambda r: r[key])
    se = float(best.get(_SE_OF.get(key, ""), 0.0) or 0.0)
    if se > 0:
        ax.axhspan(best[key] - se, best[key], color=color, alpha=0.12, label=f"within 1 s.e. of {mode}'s best")
    at_zero = next((r for r in rows if r["alpha"] == 0.0), None)
    if at_zero is not None:
        ax.axhline(at_zero[key], color="black", linestyle="--", linewidth=0.8, label="old->old (alpha 0)")
    if ceiling is not None and key in ceiling:
        ax.axhline(ceiling[key], color="green", linestyle="-.", linewidth=0.8, label="new->new (re-indexed gallery)")


def verdict_line(report: dict[str, Any]) -> str | None:
    """The chosen weight's cross-fitted R@1 against old->old and new->new, and the share of the gain it keeps."""
    mode = next(iter(report.get("chosen", {})), None)
    rows = report.get("support_recall", {}).get(mode, [])
    at_zero = next((r for r in rows if r["alpha"] == 0.0), None)
    chosen = report["chosen"][mode] if mode is not None else {}
    if at_zero is None or "alpha" not in chosen or "recall@1" not in chosen:
        return None
    old = at_zero["recall@1"]
    line = (
        f"support R@1, cross-fitted: old->old {old:.3f}, {mode} at alpha {chosen['alpha']:.1f} "
        f"{chosen['recall@1']:.3f} ({100 * (chosen['recall@1'] - old):+.1f} points)"
    )
    ceiling = (report.get("new_to_new") or {}).get("recall@1")
    if ceiling is not None:
        line += f", new->new {ceiling:.3f}"
        if ceiling > old:
            line += f": {(chosen['recall@1'] - old) / (ceiling - old):.0%} of what a re-index gains"
    return line


def plot_heading(profile: Any, why: str | None) -> str:
    """The plot's heading: the profile, its two models, its head and weights, and why (alpha 0 said plainly)."""
    alphas = ", ".join(f"{m} {a:.1f}" for m, a in sorted(profile.alphas.items()))
    lines = [
        f"profile {profile.profile_id}: {profile.old_model_id} <- {profile.new_model_id}; "
        f"head {profile.head}" + (f", alpha {alphas}" if alphas else "")
    ]
    if profile.alphas and all(a == 0.0 for a in profile.alphas.values()):
        lines.append(
            "alpha 0, chosen by the rule in the panel titles: the profile serves the old query unchanged, as the old "
            "system did (the mapped new query did not raise the cross-fitted score enough)"
        )
    elif why:
        lines.append(why)
    return "\n".join(lines)


def query_pairs_line(report: dict[str, Any]) -> str:
    """One line: how many labelled rows and query pairs fitted R, and the cross-fitted scores with and without them."""
    qp = report["query_pairs"]
    w, wo = qp["with"], qp["without"]
    curve = "cross-fitted" if report.get("selection") == "cross-fit" else "same-set (biased)"
    return (
        f"R fitted on {qp['labelled_rows']} labelled rows + {qp['pairs']} unlabelled query pairs (weight "
        f"{qp['weight']:g}); {curve} aligned R@1 {wo['aligned_r1']:.4f} -> {w['aligned_r1']:.4f}, "
        f"slerp R@1 {wo['slerp_r1']:.4f} (alpha {wo['slerp_alpha']:.1f}) -> {w['slerp_r1']:.4f} "
        f"(alpha {w['slerp_alpha']:.1f}) without -> with the query pairs (± {w['slerp_se@1']:.4f})"
    )


def adapter_verdict(report: dict[str, Any]) -> list[str]:
    """The early-stopping choice and the held-out comparison with Procrustes, as printable lines."""
    lines = []
    stop = report.get("early_stopping")
    if stop:
        curve = ", ".join(f"{r['epoch']}: {r[stop['score']]:.4f}" for r in stop["curve"])
        lines.append(
            f"epochs: {stop['epochs']} of {stop['max_epochs']} ({stop['rule']}; held-out {stop['score']} by epoch: "
            f"{curve})"
        )
    vs = report.get("versus_procrustes")
    if vs:
        lines.append(("warning: " if vs["adapter_loses"] else "") + vs["verdict"])
    return lines


def correction_line(row: dict[str, Any]) -> str:
    """What the hubness correction adds to its head, in points with paired 95 % intervals, as one line."""
    from service.compat.uncertainty import describe

    head = row["method"].removesuffix("+csls")
    parts = ", ".join(
        f"{name} {describe(row['vs_uncorrected'][metric])}"
        for name, metric in (("R@1", "recall@1"), ("R@10", "recall@10"), ("nDCG@10", "ndcg@10"))
    )
    return f"{row['method']} against {head} without the correction (points, paired 95 % intervals): {parts}"


def eval_table(rows: list[dict[str, Any]], title: str, caption: str | None) -> Any:
    """Rich table of evaluation rows: the metrics, the differences from old->old with 95 % intervals, the verdicts."""
    from rich.table import Table

    from service.compat.uncertainty import describe

    def interval(row: dict[str, Any], metric: str) -> str:
        return describe(row["vs_old"][metric]) if row.get("vs_old") else "-"

    def kept(row: dict[str, Any]) -> str:
        part = (row.get("retention") or {}).get("arr@10")
        return "-" if not part else "{:.3f} [{:.3f}, {:.3f}]".format(part["value"], part["low"], part["high"])

    judged = next((r["judged_on"] for r in rows if r.get("judged_on")), "recall@10").replace("recall", "R")
    columns: list[tuple[str, Any]] = [
        ("method", lambda r: r["method"]),
        ("alpha", lambda r: fmt(r["alpha"])),
        *((m.replace("recall", "R"), lambda r, m=m: fmt(r[m])) for m in ("recall@1", "recall@5", "recall@10")),
        ("MRR@10", lambda r: fmt(r["mrr@10"])),
        ("nDCG@10", lambda r: fmt(r["ndcg@10"])),
        ("R@1 vs old (pt) [95 %]", lambda r: interval(r, "recall@1")),
        ("R@10 vs old (pt) [95 %]", lambda r: interval(r, "recall@10")),
        (f"compatible ({judged})", lambda r: fmt(r["compatible"])),
        ("compatible (R@1)", lambda r: fmt(r["compatible@1"])),
        ("ARR@10 [95 %]", kept),
        ("pfr", lambda r: fmt(r["pfr"])),
        ("nfr", lambda r: fmt(r["nfr"])),
    ]
    table = Table(title=title, caption=caption)
    for header, _ in columns:
        table.add_column(header, justify="left" if header == "method" else "right")
    for r in rows:
        table.add_row(*[cell(r) for _, cell in columns])
    return table
