"""Does refitting R with unlabelled (old, new) query pairs help?  Test R@1 of slerp and aligned, with and without them.

For every labelled support size L and traffic size T, and several draws: fit R and alpha exactly as
`nobackfill fit --add-query-pairs` does (selection.fit: 5 folds, the default criterion, the traffic
pairs in every fold's R, alpha scored on the labelled folds only), then score the profile on a fixed
test set by exact search: old->old, aligned (R alone) and SLERP at the chosen alpha.

    synthetic (the simulated upgrade of docs/synthetic-world.md; nothing here is a trained model):
        .venv/bin/python loadtest/traffic_evidence.py synthetic --json loadtest/results/traffic-synthetic.json
        test: caption 1 of 2,000 gallery items vs the 20,000 items' images (old model)
        labelled: caption 0 + image of support items (both models); traffic: caption 2 of other items;
        shifted traffic: caption 2 of items from 64 of the 4,096 clusters only (a topical shift)
    real (docs/real-models.md's corpus; build it first, docs/traffic-learning.md has the commands):
        .venv/bin/python loadtest/traffic_evidence.py real --root /tmp/nb-real --traffic 500,2000 \
            --json loadtest/results/traffic-real.json
        test: the 1,000 test queries vs the 4,520-text gallery (old model); labelled: support pairs;
        traffic: queries of the support pairs left out of the labelled draw (their labels unused; at
        most 2,000 - L exist); shifted traffic: those pairs' descriptions (long texts) as queries
Weights: --weights 0.1,0.3,1,3 sweeps query_pairs_weight on the sizes named by --sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.compat import selection  # noqa: E402
from service.compat.evaluation import slerp_curve  # noqa: E402
from service.compat.fit_options import FitOptions  # noqa: E402
from service.compat.io import Split  # noqa: E402
from service.compat.procrustes import normalize_rows  # noqa: E402

Pairs = tuple[np.ndarray, np.ndarray]  # (new, old)


def score(
    labelled: Split, traffic: list[Pairs], test: Split, targets: np.ndarray, weight: float, seed: int
) -> dict[str, Any]:
    """Fit as `fit --add-query-pairs` does, then test R@1 of old, aligned and SLERP at the chosen alpha."""
    result = selection.fit(labelled, FitOptions(seed=seed, query_pairs_weight=weight), traffic)
    curve = slerp_curve(result.rotation, test, targets)
    alpha = float(result.params["slerp"]["alpha"])
    return {
        "old": curve[0.0][1],
        "aligned": curve[1.0][1],
        "slerp": curve[alpha][1],
        "alpha": alpha,
        "oracle": max(c[1] for c in curve.values()),
    }


def split_of(
    path: str, oq: np.ndarray, nq: np.ndarray, ot: np.ndarray, nt: np.ndarray | None, qid: np.ndarray, tid: np.ndarray
) -> Split:
    """A Split from arrays."""
    return Split(Path(path), oq, nq, ot, nt, qid.astype(np.int64), tid.astype(np.int64))


class SyntheticWorld:
    """Test set, labelled draws and traffic draws from the simulated upgrade."""

    def __init__(self, gallery: int, test: int) -> None:
        from service.encoders.synthetic import IMAGE_VIEW, SyntheticNewEncoder, SyntheticOldEncoder

        self.old, self.new, self.image = SyntheticOldEncoder(), SyntheticNewEncoder(), IMAGE_VIEW
        items = np.arange(gallery, dtype=np.int64)
        q = np.sort(np.random.default_rng(0).choice(gallery, test, replace=False)).astype(np.int64)
        self.test = split_of(
            "synthetic-test",
            self.old.encode_items(q, 1),
            self.new.encode_items(q, 1),
            self.old.encode_items(items, IMAGE_VIEW),
            None,
            q,
            items,
        )
        self.targets = normalize_rows(self.test.old_target)

    def labelled(self, n: int, draw: int) -> Split:
        """Caption 0 + image of n support items (both models)."""
        items = np.arange(n, dtype=np.int64) + 10**12 + draw * 10**6
        return split_of(
            f"labelled-{n}-{draw}",
            self.old.encode_items(items, 0),
            self.new.encode_items(items, 0),
            self.old.encode_items(items, self.image),
            self.new.encode_items(items, self.image),
            items,
            items,
        )

    def traffic(self, n: int, draw: int, shifted: bool) -> Pairs:
        """Caption 2 of n other items; shifted: items of 64 of the 4,096 clusters only."""
        base = 3 * 10**12 + draw * 10**8
        if not shifted:
            items = np.arange(n, dtype=np.int64) + base
        else:
            from service.encoders.synthetic import _STREAM_CLUSTER, DEFAULT_WORLD, _hash

            found: list[np.ndarray] = []
            start = base + 5 * 10**7
            while sum(len(f) for f in found) < n:
                cand = np.arange(start, start + 10**6, dtype=np.int64)
                cluster = _hash(_STREAM_CLUSTER, DEFAULT_WORLD.seed, cand.astype(np.uint64)) % np.uint64(
                    DEFAULT_WORLD.n_clusters
                )
                found.append(cand[cluster < 64])
                start += 10**6
            items = np.concatenate(found)[:n]
        return self.new.encode_items(items, 2), self.old.encode_items(items, 2)


class RealCorpus:
    """docs/real-models.md's support set, test queries and gallery (old model), as built under --root."""

    def __init__(self, root: Path, targets_only: bool = False) -> None:
        from service.compat.io import load_split

        self.support = load_split(root / "support")
        gallery_ids = np.load(root / "corpus" / "gallery_ids.npy")
        gallery_old = np.load(root / "gallery-old.npy")
        if targets_only:  # the test queries' own 1,000 targets, as docs/real-models.md's eval table
            keep = np.isin(gallery_ids, np.load(root / "test-query-ids.npy"))
            gallery_ids, gallery_old = gallery_ids[keep], gallery_old[keep]
        self.test = split_of(
            "real-test",
            np.load(root / "test-old.npy"),
            np.load(root / "test-new.npy"),
            gallery_old,
            None,
            np.load(root / "test-query-ids.npy"),
            gallery_ids,
        )
        self.targets = normalize_rows(gallery_old)
        self.order: dict[int, np.ndarray] = {}

    def _perm(self, draw: int) -> np.ndarray:
        if draw not in self.order:
            self.order[draw] = np.random.default_rng(1000 + draw).permutation(len(self.support.old_query))
        return self.order[draw]

    def labelled(self, n: int, draw: int) -> Split:
        """n support pairs of this draw: their queries and their relevant descriptions, both models."""
        s, rows = self.support, np.sort(self._perm(draw)[:n])
        keep = np.isin(s.target_ids, s.query_ids[rows])
        nt = None if s.new_target is None else s.new_target[keep]
        return split_of(
            f"labelled-{n}-{draw}",
            s.old_query[rows],
            s.new_query[rows],
            s.old_target[keep],
            nt,
            s.query_ids[rows],
            s.target_ids[keep],
        )

    def traffic(self, n: int, draw: int, shifted: bool, skip: int) -> Pairs:
        """Queries of support pairs outside the labelled draw (at most what is left); shifted: their descriptions."""
        s, rows = self.support, self._perm(draw)[skip : skip + n]
        if shifted:
            assert s.new_target is not None, "support build writes new_target.npy"
            t_rows = np.flatnonzero(np.isin(s.target_ids, s.query_ids[rows]))
            return s.new_target[t_rows], s.old_target[t_rows]
        return s.new_query[rows], s.old_query[rows]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The docs tables from a run's rows: test R@1 (%) per labelled x traffic size, then the weight sweep."""

    def cell(r: dict[str, Any] | None, key: str) -> str:
        if r is None:
            return "-"
        sd = f" ±{r[key + '_sd'] * 100:.1f}" if r[key + "_sd"] else ""
        alpha = f" (α {r['alpha']:.2f})" if key == "slerp" else ""
        return f"{r[key] * 100:.1f}{sd}{alpha}"

    main_w = rows[0]["weight"]
    main = [r for r in rows if r["weight"] == main_w]
    lines = [
        "| labelled | traffic | old | aligned | slerp | aligned, shifted traffic | slerp, shifted traffic |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in main:
        if r["shifted"]:
            continue
        shifted = next(
            (x for x in main if x["shifted"] and (x["labelled"], x["traffic"]) == (r["labelled"], r["traffic"])), None
        )
        lines.append(
            f"| {r['labelled']} | {r['traffic']} | {r['old'] * 100:.1f} | {cell(r, 'aligned')} | {cell(r, 'slerp')} | "
            f"{cell(shifted, 'aligned')} | {cell(shifted, 'slerp')} |"
        )
    sweep = sorted({(r["labelled"], r["traffic"]) for r in rows if r["weight"] != main_w})
    if sweep:
        weights = sorted({r["weight"] for r in rows})
        lines += ["", "| labelled | traffic | " + " | ".join(f"weight {w:g}" for w in weights) + " |"]
        lines.append("|---|---|" + "---|" * len(weights))
        for n_l, n_t in sweep:
            by_w = {r["weight"]: r for r in rows if (r["labelled"], r["traffic"], r["shifted"]) == (n_l, n_t, False)}
            cells = [
                f"{by_w[w]['aligned'] * 100:.1f} / {by_w[w]['slerp'] * 100:.1f}" if w in by_w else "-" for w in weights
            ]
            lines.append(f"| {n_l} | {n_t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("world", choices=["synthetic", "real", "table"], help="table: print --json's tables")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path("artifacts/real"),
        help="real: folder with support/, test/, corpus/, gallery-{old,new}.npy",
    )
    parser.add_argument("--labelled", default="50,200,1000")
    parser.add_argument("--traffic", default="500,5000,50000")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--weights", default="", help="comma-separated weights to sweep on the --sweep sizes")
    parser.add_argument("--sweep", default="50:5000,200:5000,1000:5000", help="L:T pairs for the weight sweep")
    parser.add_argument("--no-shift", action="store_true")
    parser.add_argument("--gallery", type=int, default=20_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--test-targets-only", action="store_true", help="real: gallery = the test targets only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.world == "table":
        print(markdown(json.loads(args.json.read_text())["rows"]))
        return
    started = time.perf_counter()
    world: Any = (
        SyntheticWorld(args.gallery, args.test)
        if args.world == "synthetic"
        else RealCorpus(args.root, args.test_targets_only)
    )
    labelled_sizes = [int(x) for x in args.labelled.split(",")]
    traffic_sizes = [int(x) for x in args.traffic.split(",") if x]
    rows: list[dict[str, Any]] = []

    def traffic_of(n_l: int, n_t: int, draw: int, shifted: bool) -> list[Pairs]:
        if n_t == 0:
            return []
        if args.world == "real":
            return [world.traffic(n_t, draw, shifted, n_l)]
        return [world.traffic(n_t, draw, shifted)]

    def run(n_l: int, n_t: int, shifted: bool, weight: float) -> None:
        draws, used = [], 0
        for d in range(args.draws):
            traffic = traffic_of(n_l, n_t, d, shifted)
            used = sum(len(new) for new, _ in traffic)  # the real corpus has at most 2,000 - L
            draws.append(score(world.labelled(n_l, d), traffic, world.test, world.targets, weight, d))
        row: dict[str, Any] = {"labelled": n_l, "traffic": used, "shifted": shifted, "weight": weight}
        for key in ("old", "aligned", "slerp", "alpha", "oracle"):
            vals = np.array([d[key] for d in draws])
            row[key] = float(vals.mean())
            row[key + "_sd"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        rows.append(row)
        pct = {k: row[k] * 100 for k in ("old", "aligned", "aligned_sd", "slerp", "slerp_sd", "oracle")}
        print(
            f"L={n_l:5d} T={used:6d} {'shifted' if shifted else 'same   '} w={weight:<4g} old {pct['old']:5.1f}  "
            f"aligned {pct['aligned']:5.1f} ±{pct['aligned_sd']:4.1f}  slerp {pct['slerp']:5.1f} "
            f"±{pct['slerp_sd']:4.1f} (alpha {row['alpha']:.2f})  oracle {pct['oracle']:5.1f}",
            flush=True,
        )

    for n_l in labelled_sizes:
        run(n_l, 0, False, args.weight)
        for n_t in traffic_sizes:
            run(n_l, n_t, False, args.weight)
            if not args.no_shift:
                run(n_l, n_t, True, args.weight)
    for w in [float(x) for x in args.weights.split(",") if x]:
        for spec in args.sweep.split(","):
            n_l, n_t = (int(x) for x in spec.split(":"))
            run(n_l, n_t, False, w)
    out = {"world": args.world, "draws": args.draws, "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(markdown(rows))
    print(f"done in {out['seconds']} s")


if __name__ == "__main__":
    main()
