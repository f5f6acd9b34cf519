"""Which alpha-selection criterion lands closest to the test-set oracle?  The table of docs/alpha-selection.md.

    .venv/bin/python loadtest/bench_alpha.py NAME=SUPPORT_DIR:TEST_DIR ... [--digits] [--seeds 3]

For every upgrade (a support folder and a test folder, as `nobackfill fit` / `nobackfill eval` read
them; `--digits` adds the digits pair built in-process, see `digits_splits`), every selection scheme
-- (folds, held-out gallery) in SCHEMES -- runs selection.fit_modalities once per fold seed; every
criterion of criteria.CRITERIA then picks its SLERP weight from the same cross-fitted curves, so
the criteria are compared on identical data.  The final R (the same for every scheme: it is fitted
on all support rows) scores SLERP at every grid weight on the test split: the best of these is the
oracle (as `nobackfill eval` computes it), old->old is weight 0.  Printed per upgrade and criterion:
the mean chosen weight and test R@1 over the seeds, the gap to the oracle, and the worst seed.
Results go to loadtest/results/alpha-<time>.json.

Digits (tests/support/digits_models.py, OLD 5 classes / NEW 10 classes, penultimate features 32-d / 64-d):
instance retrieval, a noisy view of an image (pixel noise `DIGITS_NOISE`, clipped to [0, 1]) is the
query, the clean image the target, both through both models; support = the support rows, test = the
query and gallery rows of every class.  The larger NEW model is the worse instance retriever here
(its features are more class-invariant), so this is the case where the right weight is 0.  A second
digits upgrade uses class-label relevance as loadtest/bench_heads.py does (`digits_class_splits`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
sys.path.insert(0, str(ROOT))

from service.compat import criteria, curves, evaluation, selection  # noqa: E402
from service.compat.arcsearch import summarise_blends  # noqa: E402
from service.compat.fit_options import FitOptions  # noqa: E402
from service.compat.io import Split, default_ids, load_split  # noqa: E402
from service.compat.metrics import KS, recall_at_k, relevance  # noqa: E402
from service.compat.procrustes import normalize_rows  # noqa: E402
from service.vocabulary import EvalGallery  # noqa: E402

# (label, folds, held-out gallery): the fold count sets how large a held-out gallery can be.
SCHEMES: dict[str, tuple[str, int, EvalGallery]] = {
    "fold": ("5 folds", 5, "fold"),
    "fold2": ("2 folds", 2, "fold"),
    "support": ("5 folds, all targets", 5, "support"),
}
DIGITS_NOISE = 0.25


@dataclass(frozen=True)
class TestCurves:
    """Test R@1 of SLERP / NLERP at every grid weight, and what adaptive needs (theta, cos, path summary)."""

    slerp: dict[float, float]
    nlerp: dict[float, float]
    summary: Any
    cos: npt.NDArray[np.float64]
    oracle: float  # the weight `nobackfill eval` reports as the oracle

    def adaptive(self, a: float, b: float, c_ref: float) -> float:
        """Test R@1 of adaptive NLERP at (a, b, c_ref)."""
        lam = np.clip(a + b * (self.cos - c_ref), 0.0, 1.0)
        return recall_at_k(self.summary.ranks(lam), KS)[1]


def test_curves(test: Split, rotation: npt.NDArray[np.float32]) -> TestCurves:
    """SLERP test R@1 over the grid under the final R (`nobackfill eval`'s oracle curve), and NLERP's."""
    rel = relevance(test.query_ids, test.target_ids)
    targets = normalize_rows(test.old_target)
    full = evaluation.slerp_curve(rotation, test, targets)
    slerp = {a: rec[1] for a, rec in full.items()}
    summary, theta, cos = summarise_blends(test.old_query, test.new_query, rotation, targets, rel, k=max(KS))
    nlerp = {a: recall_at_k(summary.ranks(np.full(len(theta), a)), KS)[1] for a in curves.ALPHA_GRID}
    return TestCurves(slerp, nlerp, summary, cos, evaluation.oracle_alpha(full))


def digits_splits(seed: int = 0) -> tuple[Split, Split]:
    """Support and test splits of the digits pair (instance retrieval: noisy view -> clean image)."""
    from tests.support.digits_models import encode, train_pair

    pair = train_pair(seed, old_only_eval=False)
    s = pair.splits
    rng = np.random.default_rng(7 + seed)

    def split(rows: npt.NDArray[np.int64], name: str) -> Split:
        clean = s.x[rows]
        noisy = np.clip(clean + DIGITS_NOISE * rng.standard_normal(clean.shape), 0.0, 1.0).astype(np.float32)
        ids = default_ids(len(rows))
        return Split(
            Path(f"digits-{name}"),
            encode(pair.old, noisy)[0],
            encode(pair.new, noisy)[0],
            encode(pair.old, clean)[0],
            encode(pair.new, clean)[0],
            ids,
            ids.copy(),
        )

    return split(s.support, "support"), split(np.concatenate([s.query, s.gallery]), "test")


def digits_class_splits(seed: int = 0) -> tuple[Split, Split]:
    """Support and test splits of the digits pair as loadtest/bench_heads.py builds them (class-label relevance).

    Support: the support rows of every class, even rows queries, odd rows targets, ids = labels (so
    folds are drawn per class).  Test: the query rows against a gallery of the gallery rows, classes 0-4.
    """
    from tests.support.digits_models import encode, train_pair

    pair = train_pair(seed)
    s = pair.splits
    f_old, f_new = encode(pair.old, s.x[s.support])[0], encode(pair.new, s.x[s.support])[0]
    labels = s.y[s.support]
    support = Split(
        Path("digits-class-support"), f_old[::2], f_new[::2], f_old[1::2], f_new[1::2], labels[::2], labels[1::2]
    )
    q, g = s.query, s.gallery
    test = Split(
        Path("digits-class-test"),
        encode(pair.old, s.x[q])[0],
        encode(pair.new, s.x[q])[0],
        encode(pair.old, s.x[g])[0],
        None,
        s.y[q],
        s.y[g],
    )
    return support, test


def one_upgrade(
    name: str, support: Split, test: Split, seeds: int, eval_queries: int, schemes: list[str]
) -> dict[str, Any]:
    """Every scheme x criterion on one upgrade: chosen weights and test R@1 per seed."""
    out: dict[str, Any] = {"name": name, "support_queries": len(support.old_query), "test_queries": len(test.old_query)}
    curves: TestCurves | None = None
    picks: dict[str, list[dict[str, Any]]] = {}
    heads: list[dict[str, Any]] = []
    support_curves: list[dict[str, Any]] = []
    started = time.perf_counter()
    for label, folds, gallery in (SCHEMES[s] for s in schemes):
        for seed in range(seeds):
            fitted = selection.fit_modalities(
                {"text": support}, FitOptions(folds=folds, seed=seed, eval_queries=eval_queries, eval_gallery=gallery)
            )
            if curves is None:
                curves = test_curves(test, fitted.rotation)
            rep = fitted.reports["text"]
            support_curves.append({"scheme": label, "seed": seed, "slerp": rep["support_recall"]["slerp"]})
            for criterion in criteria.CRITERIA:
                alpha = criteria.choose(rep["support_recall"]["slerp"], criterion)["alpha"]
                picks.setdefault(f"{label} | {criterion}", []).append({"seed": seed, "alpha": alpha})
            if (folds, gallery) == (5, selection.DEFAULT_EVAL_GALLERY):
                heads.append(_head_row(rep, curves, seed))
    assert curves is not None
    oracle_alpha = curves.oracle
    out["old"] = curves.slerp[0.0]
    out["aligned"] = curves.slerp[1.0]
    out["oracle"] = {"alpha": oracle_alpha, "r1": curves.slerp[oracle_alpha]}
    out["test_slerp_curve"] = curves.slerp
    out["criteria"] = {}
    for key, runs in picks.items():
        r1 = [curves.slerp[p["alpha"]] for p in runs]
        out["criteria"][key] = {
            "alphas": [p["alpha"] for p in runs],
            "mean_alpha": float(np.mean([p["alpha"] for p in runs])),
            "mean_r1": float(np.mean(r1)),
            "worst_r1": float(np.min(r1)),
            "gap": float(curves.slerp[oracle_alpha] - np.mean(r1)),
            "worst_gap": float(curves.slerp[oracle_alpha] - np.min(r1)),
        }
    out["heads"] = heads
    out["support_curves"] = support_curves
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def _head_row(rep: dict[str, Any], curves: TestCurves, seed: int) -> dict[str, Any]:
    """The head `fit` would pick (default criterion, 5 folds) and the test R@1 of each blend at its chosen point."""
    chosen = rep["chosen"]
    ad = chosen["adaptive"]
    return {
        "seed": seed,
        "best_head": rep["best_head"]["head"],
        "slerp": curves.slerp[chosen["slerp"]["alpha"]],
        "nlerp": curves.nlerp[chosen["nlerp"]["alpha"]],
        "adaptive": curves.adaptive(ad["a"], ad["b"], ad["c_ref"]),
    }


def _print(result: dict[str, Any]) -> None:
    """One upgrade's table, criteria sorted by their worst gap to the oracle."""
    print(
        f"\n## {result['name']}: {result['support_queries']} support / {result['test_queries']} test queries, "
        f"old->old {100 * result['old']:.1f}, aligned {100 * result['aligned']:.1f}, oracle alpha "
        f"{result['oracle']['alpha']:.1f} R@1 {100 * result['oracle']['r1']:.1f}  ({result['seconds']} s)"
    )
    print(
        "test SLERP R@1 by alpha: " + " ".join(f"{a:.1f}:{100 * r:.1f}" for a, r in result["test_slerp_curve"].items())
    )
    rows = sorted(result["criteria"].items(), key=lambda kv: (kv[1]["worst_gap"], kv[1]["gap"]))
    for key, c in rows:
        print(
            f"  {key:34s} alphas {' '.join(f'{a:.1f}' for a in c['alphas'])}  R@1 {100 * c['mean_r1']:.2f} "
            f"(worst {100 * c['worst_r1']:.2f})  gap {100 * c['gap']:.2f} (worst {100 * c['worst_gap']:.2f})"
        )
    for h in result["heads"]:
        print(
            f"  head seed {h['seed']}: fit picks {h['best_head']}; test R@1 slerp {100 * h['slerp']:.2f}, "
            f"nlerp {100 * h['nlerp']:.2f}, adaptive {100 * h['adaptive']:.2f}"
        )


def summary(results: list[dict[str, Any]]) -> None:
    """Per scheme x criterion over every upgrade: worst gap to the oracle, mean gap, seeds below old->old."""
    print("\n## every upgrade: worst / mean gap to the oracle (R@1 points), runs below old->old")
    keys = results[0]["criteria"].keys()
    rows = []
    for key in keys:
        runs = [r["criteria"][key] for r in results]
        below = sum(sum(curve_r1 < r["old"] for curve_r1 in _run_r1(r, key)) for r in results)
        rows.append((max(c["worst_gap"] for c in runs), float(np.mean([c["gap"] for c in runs])), below, key))
    for worst, mean, below, key in sorted(rows):
        print(f"  {key:34s} worst {100 * worst:.2f}  mean {100 * mean:.2f}  below old {below}")


def _run_r1(result: dict[str, Any], key: str) -> list[float]:
    """Test R@1 of every seed's chosen weight for one scheme x criterion."""
    curve = result["test_slerp_curve"]
    return [curve[a] for a in result["criteria"][key]["alphas"]]


def main() -> None:
    """Parse NAME=SUPPORT:TEST pairs, run every upgrade, print and save the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upgrades", nargs="*", help="NAME=SUPPORT_DIR:TEST_DIR")
    parser.add_argument("--summarise", type=Path, help="Only print the summary of a saved results file.")
    parser.add_argument("--digits", action="store_true", help="Add the digits pair (built in-process).")
    parser.add_argument("--seeds", type=int, default=3, help="Fold seeds per scheme.")
    parser.add_argument("--eval-queries", type=int, default=2000, help="Held-out queries scored per fold.")
    parser.add_argument("--schemes", default="fold,fold2,support", help=f"Comma-separated, of {', '.join(SCHEMES)}.")
    args = parser.parse_args()
    if args.summarise:
        saved = json.loads(args.summarise.read_text())["results"]
        for r in saved:
            r["test_slerp_curve"] = {float(a): v for a, v in r["test_slerp_curve"].items()}
        summary(saved)
        return
    results = []
    todo: list[tuple[str, Split, Split]] = []
    for spec in args.upgrades:
        name, _, dirs = spec.partition("=")
        sup, _, tst = dirs.partition(":")
        todo.append((name, load_split(sup), load_split(tst)))
    if args.digits:
        todo.append(("digits (instance)", *digits_splits()))
        todo.append(("digits (class)", *digits_class_splits()))
    for name, support, test in todo:
        result = one_upgrade(name, support, test, args.seeds, args.eval_queries, args.schemes.split(","))
        _print(result)
        results.append(result)
    if results:
        summary(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    path = RESULTS / f"alpha-{stamp}.json"
    path.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1, default=float) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
