"""Does adapter+slerp help?  Procrustes + SLERP, the MKP adapter and adapter+slerp side by side on digits.

    .venv/bin/python loadtest/bench_heads.py digits [--pairs 5 --epochs 100 --folds 5]

For each of `--pairs` digits model pairs (tests/support/digits_models.py: OLD 5 classes, NEW 10 classes), the
penultimate features (new 64-d -> old 32-d) of the support split (all classes; even rows as queries,
odd rows as targets, both through both models, ids = class labels) feed the same library calls as
`nobackfill fit` (selection.fit for the slerp head, mapped_selection.fit_mapped_slerp with train_adapter for
adapter+slerp), and `nobackfill eval`'s evaluation.evaluate scores them on held-out queries against a
held-out old-model gallery of the old classes 0-4 (class-label relevance).  Because the ids are
labels, cross-fitting folds are drawn per class: every fold's map has never seen that fold's classes.
The adapter uses fp32 and batch 128 as in the digits experiment.  The stand-in figures of
docs/benchmarks.md come from the CLI itself (commands there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
sys.path.insert(0, str(ROOT))

from service.compat import mapped_selection, selection  # noqa: E402
from service.compat.adapter import AdapterConfig, TrainedAdapter, train_adapter  # noqa: E402
from service.compat.evaluation import evaluate  # noqa: E402
from service.compat.fit_options import FitOptions  # noqa: E402
from service.compat.io import load_split  # noqa: E402
from service.compat.profile import CompatProfile  # noqa: E402

METHODS = ("old", "aligned", "slerp", "adapter", "adapter+slerp")


def _write(folder: Path, parts: dict[str, np.ndarray]) -> Path:
    """Save one split folder."""
    folder.mkdir(parents=True)
    for name, arr in parts.items():
        np.save(folder / f"{name}.npy", arr)
    return folder


def one_pair(seed: int, epochs: int, folds: int, root: Path) -> dict[str, dict[str, Any]]:
    """Fit both profiles on one model pair's support features and evaluate them; rows keyed by method."""
    from tests.support.digits_models import OLD_CLASSES, encode, train_pair

    pair = train_pair(seed)
    s = pair.splits
    sup = s.support
    f_old, f_new = encode(pair.old, s.x[sup])[0], encode(pair.new, s.x[sup])[0]
    support = _write(
        root / f"support-{seed}",
        {
            "old_query": f_old[::2],
            "new_query": f_new[::2],
            "old_target": f_old[1::2],
            "new_target": f_new[1::2],
            "query_ids": s.y[sup][::2],
            "target_ids": s.y[sup][1::2],
        },
    )
    q, g = s.query, s.gallery
    assert (s.y[q] < OLD_CLASSES).all() and (s.y[g] < OLD_CLASSES).all()
    test = _write(
        root / f"test-{seed}",
        {
            "old_query": encode(pair.old, s.x[q])[0],
            "new_query": encode(pair.new, s.x[q])[0],
            "old_target": encode(pair.old, s.x[g])[0],
            "query_ids": s.y[q],
            "target_ids": s.y[g],
        },
    )
    sup_split, test_split = load_split(support), load_split(test)
    base = {
        "old_model_id": "digits-old",
        "new_model_id": "digits-new",
        "old_dim": sup_split.old_dim,
        "new_dim": sup_split.new_dim,
        "fit_on": "both",
        "folds": folds,
    }
    fitted = selection.fit(sup_split, FitOptions(folds=folds, seed=seed))
    procrustes = CompatProfile(
        head="slerp",
        alphas={"text": fitted.params["slerp"]["alpha"]},
        params={"text": fitted.params},
        fit_report=fitted.report,
        tensors={"R": fitted.rotation},
        **base,  # type: ignore[arg-type]
    )
    config = AdapterConfig(epochs=epochs, batch_size=128, seed=seed, precision="fp32")

    def fit_map(new: np.ndarray, old: np.ndarray) -> TrainedAdapter:
        return train_adapter(new, old, config, progress=False)

    mapped = mapped_selection.fit_mapped_slerp(sup_split, fit_map, FitOptions(folds=folds, seed=seed))
    blended = CompatProfile(
        head="adapter+slerp",
        alphas={"text": mapped.alpha},
        params={"text": {"adapter+slerp": {"alpha": mapped.alpha}}},
        fit_report=mapped.report,
        tensors={k: v.numpy() for k, v in mapped.mapper.state_dict_tensors().items()},
        adapter=mapped.mapper.meta(),
        **base,  # type: ignore[arg-type]
    )
    rows = {r["method"]: r for r in evaluate(procrustes, test_split, "text")}
    rows.update({r["method"]: r for r in evaluate(blended, test_split, "text")})
    return {m: rows[m] for m in METHODS}


def bench_digits(pairs: int, epochs: int, folds: int) -> dict[str, Any]:
    """Mean Recall@1 / flips per method over the pairs, and how many pairs each is compatible on."""
    torch.set_num_threads(1)
    per_pair = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(pairs):
            t = time.perf_counter()
            per_pair.append(one_pair(seed, epochs, folds, Path(tmp)))
            alphas = {m: per_pair[-1][m]["alpha"] for m in ("slerp", "adapter+slerp")}
            print(f"pair {seed}: {time.perf_counter() - t:.1f} s, alphas {alphas}", flush=True)
    lines = [
        "| method | R@1 new->old | R@5 | PFR | NFR | compatible (R@1) | alpha per pair |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for m in METHODS:
        rows = [p[m] for p in per_pair]
        compat = "-" if m == "old" else f"{sum(bool(r['compatible']) for r in rows)}/{pairs}"
        alphas = ", ".join("-" if r["alpha"] is None else f"{r['alpha']:.1f}" for r in rows)
        mean = {key: float(np.mean([r[key] for r in rows])) for key in ("recall@1", "recall@5", "pfr", "nfr")}
        lines.append(
            f"| {m} | {mean['recall@1']:.4f} | {mean['recall@5']:.4f} | {mean['pfr']:.4f} | {mean['nfr']:.4f} "
            f"| {compat} | {alphas} |"
        )
    table = "\n".join(lines)
    print(table, flush=True)
    return {"table": table, "per_pair": per_pair}


def main() -> None:
    """Parse the sub-command, run it, print and save the results as JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["digits"])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--folds", type=int, default=5)
    args = ap.parse_args()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    result = {"started": started, "command": " ".join(sys.argv), **bench_digits(args.pairs, args.epochs, args.folds)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"heads_{args.what}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
