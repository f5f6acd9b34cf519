"""`nobackfill profile show` and `profile compare`: look at one profile, or weigh a candidate against the served one.

Heavy imports (numpy, rich, service.compat) happen inside the commands so `nobackfill --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from service.commands import render
from service.vocabulary import HeadFamily

if TYPE_CHECKING:
    from service.compat.profile import CompatProfile


def _show_text(profile: CompatProfile, directory: Path) -> None:
    """Human-readable dump of a profile and its fit report, whatever its head."""

    console = render.console()
    rep = profile.fit_report
    console.print(f"profile {profile.profile_id}  ({directory})")
    console.print(f"  head {profile.head}; modes {', '.join(profile.modes())}")
    console.print(f"  old model {profile.old_model_id} (dim {profile.old_dim})")
    if profile.family is HeadFamily.classes:
        _show_classes(console, profile)
    elif profile.family is HeadFamily.adapter:
        _show_adapter(console, profile)
    else:
        console.print(f"  new model {profile.new_model_id} (dim {profile.new_dim}); R is {profile.dim}x{profile.dim}")
    for side, identity in (profile.models or {}).items():
        console.print(
            f"  {side} model identity: backend {identity.get('backend')}, fingerprint {identity.get('fingerprint')}"
        )
    if "fit_rows" in rep:
        console.print(
            f"  fit on {profile.fit_on} ({rep.get('fit_rows')} rows), {rep.get('selection')}, folds {profile.folds}"
        )
    if "eval_queries" in rep:
        console.print(
            f"  support {rep.get('support_queries')} queries / {rep.get('support_targets')} targets; "
            f"{rep.get('eval_queries')} queries scored vs {rep.get('eval_gallery')}"
        )
    else:
        console.print(f"  support {rep.get('support_queries')} queries / {rep.get('support_targets')} targets")
    console.print(f"  alphas {profile.alphas}")
    for modality, params in profile.params.items():
        for mode, p in params.items():
            console.print(f"  {modality}/{mode}: " + ", ".join(f"{k}={v:.4g}" for k, v in p.items()))
    console.print(f"  tensors sha256 {profile.tensors_sha256}; created {profile.created_at}")
    # A profile fitted on several --support folders keeps one selection report per query modality.
    for modality, sub in rep.get("modalities", {"": rep}).items():
        _show_selection(console, sub, modality)
    if "support_eval" in rep:
        console.print(render.eval_table(rep["support_eval"], "on the support logits", None))


def _show_selection(console: Any, rep: dict[str, Any], modality: str) -> None:
    """The chosen weights, residual angles and support curve of one selection report."""
    prefix = f"  {modality} queries: " if modality else "  "
    if modality and "support_dir" in rep:
        console.print(f"{prefix}support {rep['support_dir']} ({rep.get('support_queries')} queries)")
    for mode, best in rep.get("chosen", {}).items():
        recalls = ", ".join(f"R@{k} {best[f'recall@{k}']:.4f}" for k in (1, 5, 10) if f"recall@{k}" in best)
        console.print(f"{prefix}chosen {mode}: support {recalls}")
    if "best_head" in rep:
        console.print(f"{prefix}best head {rep['best_head']['head']}: {rep['best_head']['why']}")
    if "query_pairs" in rep:
        console.print(prefix + render.query_pairs_line(rep))
    for key in ("residual_angle_deg", "residual_angle_deg_out_of_fold"):
        if key in rep:
            stats = ", ".join(f"{k} {v:.2f}" for k, v in rep[key].items())
            console.print(f"{prefix}{key.replace('_deg', '').replace('_', ' ')} (degrees): {stats}")
    if "fold_fit_seconds" in rep:
        console.print(f"{prefix}fold fits (s): {', '.join(f'{x:.2f}' for x in rep['fold_fit_seconds'])}")
    if "support_recall" in rep:
        label = f"{modality} queries: " if modality else ""
        console.print(render.recall_table(rep, f"{label}support recall ({rep.get('selection')}, * = chosen)"))


def _show_adapter(console: Any, profile: CompatProfile) -> None:
    """The adapter block of `profile show`: shape, training settings and outcome."""
    meta = profile.adapter or {}
    cfg = meta.get("config", {})
    tr = meta.get("report", {})
    history = tr.get("history") or [{}]
    console.print(
        f"  new model {profile.new_model_id} (dim {profile.new_dim}); MKP adapter "
        f"{profile.new_dim} -> {meta.get('hidden')} -> {profile.old_dim} ({meta.get('format')})"
    )
    settings = ("epochs", "batch_size", "lr", "weight_decay", "dropout", "lam", "m", "gamma", "seed", "precision")
    console.print("  adapter config: " + ", ".join(f"{k}={cfg.get(k)}" for k in settings))
    loss = history[-1].get("total")
    console.print(
        f"  adapter training: {tr.get('pairs')} pairs, {tr.get('steps')} steps, {tr.get('seconds')} s on "
        f"{tr.get('device')} ({tr.get('autocast')}); final loss {render.fmt(loss)}"
    )
    for line in render.adapter_verdict(profile.fit_report):
        console.print("  " + line)


def _show_classes(console: Any, profile: CompatProfile) -> None:
    """The psp / lsp block of `profile show`: class counts, top-k, class map, P_tk."""
    rep = profile.fit_report
    console.print(
        f"  new model {profile.new_model_id} (dim {profile.new_dim}); {profile.head}: "
        f"{profile.old_classes} old classes -> {profile.new_dim} new classes, top_k {profile.top_k or 'all'}, "
        f"class map {profile.class_map or 'identity'}"
    )
    p_tk = profile.tensors["P_tk"]
    console.print(
        f"  P_tk {p_tk.shape[0]}x{p_tk.shape[1]} (data-free); old prototypes turn by "
        f"{render.fmt(rep.get('prototype_rotation_deg'))} degrees without it"
    )


def profile_show(
    profile_dir: Path = typer.Argument(..., help="Compat profile folder.", metavar="PROFILE_DIR"),
    as_json: bool = typer.Option(False, "--json", help="Print profile.json as loaded (verified) instead."),
) -> None:
    """Show a profile: ids, dims, weights, residual angles, support recall per alpha, checksum."""
    from service.compat.profile import load_profile

    profile = load_profile(profile_dir)
    if as_json:
        typer.echo(json.dumps({"profile_id": profile.profile_id, **profile.metadata()}, indent=2))
        return
    _show_text(profile, profile_dir)


def profile_compare(
    current: Path = typer.Argument(..., help="The profile being served.", metavar="CURRENT"),
    candidate: Path = typer.Argument(
        ..., help="The profile that would replace it (e.g. refitted with traffic).", metavar="CANDIDATE"
    ),
    test_dir: Path = typer.Argument(..., help="Labelled test folder (the `eval` layout).", metavar="TEST_DIR"),
    traffic: Path | None = typer.Option(
        None, "--traffic", help="Exported traffic folder: shadow agreement of the two profiles on its queries."
    ),
    query_modality: str | None = typer.Option(None, help="Modality to score (default: the current profile's one)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as one JSON object."),
    json_out: Path | None = typer.Option(
        None, "--json-out", help="Also write it with both profiles' ids as JSON here (NOBACKFILL_API__UI_COMPARE)."
    ),
    strict: bool = typer.Option(False, help="Refuse all-zero rows instead of dropping their pairs."),
    max_nfr: float = typer.Option(
        0.03, "--max-nfr", min=0.0, max=1.0, help="Share of the queries the current profile answers that may break."
    ),
    judge: str = typer.Option("recall@10", "--judge", help="Metric judged beside R@1 (recall@5, recall@10, ...)."),
) -> None:
    """The rollout gate. Exit 0 pass, 1 fail (worse, or breaks too much), 3 not enough data to tell, 4 refused."""
    from service.compat.io import load_query_pairs, load_split
    from service.compat.profile import load_profile
    from service.compat.uncertainty import METRICS
    from service.errors import InputError
    from service.scoring.compare import EXIT_CODES, compare

    if judge not in METRICS:
        raise InputError(f"--judge must be one of {', '.join(METRICS)}, got {judge!r}")
    cur, cand = load_profile(current), load_profile(candidate)
    test = load_split(test_dir, old_dim=cur.old_dim, new_dim=cur.new_dim, strict=strict)
    pairs = None
    if traffic is not None:
        loaded = load_query_pairs(traffic)
        pairs = (loaded.old, loaded.new)
    result = compare(cur, cand, test, traffic=pairs, modality=query_modality, max_nfr=max_nfr, judge=judge)
    if result["warning"]:
        typer.echo(f"warning: {result['warning']}", err=True)
    if json_out is not None:
        from service.compat.saved import compare_document, write_document

        write_document(json_out, compare_document(result, cur, cand))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _print_comparison(result)
    if result["outcome"] != "pass":
        raise typer.Exit(EXIT_CODES[result["outcome"]])


def _print_comparison(result: dict[str, object]) -> None:
    """The comparison as a table and a few lines, ending with the verdict."""
    from rich.table import Table

    from service.compat.uncertainty import describe

    r: dict[str, Any] = dict(result)
    console = render.console()  # the terminal's width, or 240 columns when piped: the table never wraps its cells
    if "current" in r:
        table = Table(title=f"profile compare on {r['test']} ({r['queries']} {r['modality']} queries)")
        judged = r["judged_on"].replace("recall", "R")
        columns = ("profile", "head", "alpha", "R@1", "R@5", "R@10", f"vs old {judged} (pt)", "vs old R@1 (pt)")
        for col in (*columns, f"compatible ({judged} / R@1)", "pfr", "nfr"):
            table.add_column(col, justify="left" if col in ("profile", "head") else "right")
        recalls = [f"{r['old'][f'recall@{k}']:.4f}" for k in (1, 5, 10)]
        table.add_row("old->old", "old", "0", *recalls, "-", "-", "-", "-", "-")
        for name in ("current", "candidate"):
            p = r[name]
            alpha = "-" if p["alpha"] is None else f"{p['alpha']:.2f}"
            recalls = [f"{p[f'recall@{k}']:.4f}" for k in (1, 5, 10)]
            table.add_row(
                f"{name} {p['profile_id'][:12]}",
                p["head"],
                alpha,
                *recalls,
                describe(p["vs_old"][r["judged_on"]]),
                describe(p["vs_old"]["recall@1"]),
                f"{p['compatible']} / {p['compatible@1']}",
                f"{p['pfr']:.4f}",
                f"{p['nfr']:.4f}",
            )
        console.print(table)
        d = r["difference"]
        console.print(
            f"candidate - current: R@1 {d['recall@1']:+.4f} (paired standard error {d['se@1']:.4f}); it fixes "
            f"{d['fixed']} and breaks {d['broken']} queries at R@1 (sign test, P(this many broken | equally good) = "
            f"{d['p_worse']:.2g}; worse beyond the noise below {r['p_worse']:g}); it breaks "
            f"{d['nfr_vs_current']:.1%} of the queries (at most {r['max_nfr']:.0%})"
        )
    if "traffic" in r:
        t = r["traffic"]
        angles = t["residual_angle_deg"]
        angle_text = ", ".join(
            f"{name} median {a['median']:.1f} (p95 {a['p95']:.1f})" for name, a in angles.items() if a is not None
        )
        console.print(
            f"traffic shadow ({t['pairs']} queries over {t['gallery']}): overlap@10 {t['overlap@10']:.3f} "
            f"(p5 {t['overlap@10_p5']:.2f}); residual angle, degrees: {angle_text or '-'}"
        )
    if r["outcome"] == "pass":
        console.print("PASS: the candidate is compatible and not worse than the current profile beyond the noise")
    label = {"fail": "FAIL", "undecided": "UNDECIDED", "refused": "REFUSED"}.get(r["outcome"], "")
    for reason in r["reasons"]:
        console.print(f"{label}: {reason}")
