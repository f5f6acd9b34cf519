"""What `nobackfill fit` prints once the profile is saved: the support curves, the chosen weights, the
head and its checks (calibration, hubness), and the warnings a small support set or a zero weight earns.

Split out of commands/fit.py, which parses the flags and saves the profile.  Heavy imports stay inside
the functions, as in every command module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from service.commands import render
from service.vocabulary import HeadFamily

if TYPE_CHECKING:
    from service.compat.fit_options import FitOutcome
    from service.compat.profile import CompatProfile


def print_outcome(outcome: FitOutcome, saved: CompatProfile, wrote: str) -> None:
    """The report of a saved fit, by family, ending with `wrote` (where the profile went); then the warnings."""
    wrote = "\n".join([*_calibration_lines(saved), *_hubness_lines(saved), wrote])
    if saved.family is HeadFamily.classes:
        _print_classes(outcome, wrote)
    elif saved.family is HeadFamily.adapter:
        _print_adapter(outcome, wrote)
    elif len(outcome.supports) > 1:
        _print_modalities(outcome, wrote)
    else:
        _print_procrustes(outcome, wrote)
    for line in _small_data_lines(outcome):
        warn(line)


def _small_data_lines(outcome: FitOutcome) -> list[str]:
    """What a small support set or a zero weight means for the served profile, said out loud."""
    from service.compat.uncertainty import few_queries_line
    from service.vocabulary import BLEND_MODES

    profile, lines = outcome.profile, []
    for modality, report in outcome.reports.items():
        queries = report.get("support_queries")
        if isinstance(queries, int) and (line := few_queries_line(queries, f"the {modality} support set")):
            lines.append(line + "; the chosen weight may be noise")
        if profile.head in BLEND_MODES and profile.alphas.get(modality) == 0.0:
            lines.append(
                f"alpha 0 for {modality} queries: the {profile.head} head serves the old query unchanged (old->old), "
                "so this profile answers as the old system did; on this support the mapped new query did not help "
                "(more support pairs, or the adapter head, may)"
            )
    return lines


def _hubness_lines(profile: CompatProfile) -> list[str]:
    """One line per modality on whether the hubness correction helped the head on the support (fitting.py)."""
    from service.compat.uncertainty import describe

    lines = []
    for modality, check in (profile.fit_report.get("hubness") or {}).items():
        if not check.get("decided"):
            lines.append(f"hubness correction ({modality}): not checked ({check.get('why')})")
            continue
        said = (
            "helps: serve it with `nobackfill gallery hubness` and NOBACKFILL_COMPAT__HUBNESS_DIR"
            if check["helps"]
            else "not shown to help: leave it off"
        )
        lines.append(
            f"hubness correction ({modality}, cross-fitted on the support): R@1 {check['recall@1_without']:.4f} -> "
            f"{check['recall@1_with']:.4f} ({describe(check['difference'])} points), R@10 "
            f"{check['recall@10_without']:.4f} -> {check['recall@10_with']:.4f} ({describe(check['difference@10'])}); "
            f"{said}"
        )
    return lines


def _directions(background: dict[str, Any]) -> str:
    """', read in 128 / 128 principal directions' where a space's references were reduced (old / new; 'whole')."""
    kept = background.get("directions")
    if not kept:
        return ""
    return ", read in " + " / ".join("whole" if r is None else str(r) for r in kept) + " principal directions"


def _calibration_lines(profile: CompatProfile) -> list[str]:
    """One line per modality on the hybrid merge's score map (none where the support had no new targets)."""
    lines = []
    for modality, report in (profile.fit_report.get("calibration") or {}).items():
        background = report.get("background")
        over = ""
        if background:
            rows = f"{background['references']:,} reference rows{_directions(background)}"
            over = f" over each query's background ({rows})"
        lines.append(
            f"hybrid calibration ({modality}): segment score x {report['scale']:.3f} {report['shift']:+.3f}{over} "
            f"onto the old scale; {report['right_decisions']:.1%} of {report['queries']:,} support queries' "
            "cross-space rank-1 decisions right"
        )
    return lines


def warn(line: str) -> None:
    """One warning line on stderr."""
    typer.echo(f"warning: {line}", err=True)


def _print_procrustes(outcome: FitOutcome, wrote: str) -> None:
    """One support folder, a Procrustes head: the support curves, the chosen weights and the head."""
    profile = outcome.profile
    ((modality, report),) = outcome.reports.items()
    params = profile.params[modality]
    console = render.console()
    console.print(render.recall_table(report, f"support recall ({report['selection']}, * = chosen)"))
    ad = params["adaptive"]
    console.print(
        f"chosen alpha ({modality}, {report['criterion_text']}): slerp {params['slerp']['alpha']:.1f}, "
        f"nlerp {params['nlerp']['alpha']:.1f}, "
        f"adaptive a={ad['a']:.1f} b={ad['b']:g} c_ref={ad['c_ref']:.4f}; "
        f"head {profile.head} -> alpha {profile.alphas[modality]:.2f}"
    )
    if "query_pairs" in report:
        console.print(render.query_pairs_line(report))
        console.print(report["query_pairs"]["verdict"])
    if outcome.head_why is not None:
        console.print(f"head {profile.head}: {outcome.head_why}")
    console.print(wrote)


def _print_modalities(outcome: FitOutcome, wrote: str) -> None:
    """Several support folders: each modality's curves and weights, then the one R and the head."""
    profile = outcome.profile
    first_rep = next(iter(outcome.reports.values()))
    console = render.console()
    for m, rep in outcome.reports.items():
        console.print(render.recall_table(rep, f"{m} queries: support recall ({first_rep['selection']})"))
        p = profile.params[m]
        console.print(
            f"chosen alpha ({m}): slerp {p['slerp']['alpha']:.1f}, nlerp {p['nlerp']['alpha']:.1f}, "
            f"adaptive a={p['adaptive']['a']:.1f} b={p['adaptive']['b']:g} c_ref={p['adaptive']['c_ref']:.4f}"
        )
        if "query_pairs" in rep:
            console.print(f"{m} queries: " + render.query_pairs_line(rep))
    console.print(
        f"one R over {profile.fit_report['fit_rows']} pairs of {', '.join(outcome.reports)} queries "
        f"({first_rep['criterion_text']}); "
        f"head {profile.head} -> alphas " + ", ".join(f"{m} {a:.2f}" for m, a in profile.alphas.items())
    )
    if outcome.head_why is not None:
        console.print(f"head {profile.head}: {outcome.head_why}")
    console.print(wrote)


def _print_adapter(outcome: FitOutcome, wrote: str) -> None:
    """An adapter head: the SLERP curve when one was chosen, the training run and the comparison with Procrustes."""
    profile = outcome.profile
    ((modality, report),) = outcome.reports.items()
    meta = profile.adapter or {}
    trained = meta.get("report", {})
    console = render.console()
    if "support_recall" in report:
        console.print(render.recall_table(report, f"support recall ({report['selection']}, * = chosen)"))
        console.print(f"chosen alpha ({modality}): {profile.head} {profile.alphas[modality]:.1f}")
    last = trained.get("history", [{}])[-1]
    console.print(
        f"adapter {profile.new_dim} -> {meta.get('hidden')} -> {profile.old_dim}: {trained.get('pairs')} pairs, "
        f"{trained.get('steps')} steps, {trained.get('seconds')} s on {trained.get('device')}, "
        f"final loss {last.get('total', float('nan')):.4f}"
    )
    for line in render.adapter_verdict(report):
        console.print(line)
    console.print(wrote)


def _print_classes(outcome: FitOutcome, wrote: str) -> None:
    """psp / lsp: the head scored on the support logits, and the class counts P_tk was built from."""
    profile = outcome.profile
    classes = profile.classes or {}
    ((_, support_dir),) = outcome.supports.items()
    console = render.console()
    console.print(
        render.eval_table(
            profile.fit_report["support_eval"], f"{profile.head} on the support logits ({support_dir})", None
        )
    )
    console.print(
        f"{profile.head}: {classes['old_classes']} old classes -> {classes['new_classes']} new classes, top_k "
        f"{classes['top_k'] or 'all'}, class map {classes['class_map'] or 'identity'}; old prototypes turn by "
        f"{profile.fit_report['prototype_rotation_deg']:.2f} degrees, undone by P_tk"
    )
    console.print(wrote)
