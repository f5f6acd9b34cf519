"""`nobackfill profile compare` without the CLI: the rollout gate between the served profile and a candidate.

Both profiles serve their own head (the mode the service answers with by default) on one labelled
test split, by exact search against its old targets, exactly as `eval` scores them: R@1/5/10, the
differences from old->old with 95 % paired bootstrap intervals and their verdicts (uncertainty.py),
PFR / NFR against old->old, plus the flips between the two profiles.

The outcome, one of four (the CLI's exit code in brackets):
    refused (4)     the profiles serve different models: there is nothing to compare
    fail (1)        the candidate is worse than old->old beyond the noise on the judged metric (R@10 by
                    default) or on R@1; or worse than the current profile beyond the noise (below); or
                    it breaks more than max_nfr of the queries (NFR against the current profile at R@1:
                    a candidate that breaks what users had is not safe because it fixes more)
    undecided (3)   none of that, but the test set cannot tell the candidate from old->old on either metric
    pass (0)        better than old->old beyond the noise on the judged metric or on R@1, and none of the above

The noise rule.  Both profiles answer the same queries, so the comparison is paired and only the
queries they disagree on at R@1 carry information: b = queries the candidate breaks (current hit,
candidate miss), c = queries it fixes.  If the two were equally good, each of those b + c queries
would fall either way with probability 1/2, so b ~ Binomial(b + c, 1/2) (the exact one-sided
McNemar / sign test).  The candidate is worse beyond the noise when P(B >= b) < P_WORSE (2.5 %).
The exact test, not mean(d) / se: with a handful of discordant queries (two nearly equal profiles)
the normal approximation would call 4 broken and 0 fixed significant (z = -2) where the exact
probability is 1/16.  The report also gives the R@1 difference and its paired standard error.

Shadow agreement (given exported traffic pairs): both profiles transform the same traffic queries
and search the test split's old targets (the only gallery `compare` holds; it stands in for the
served one); overlap@10 is the mean share of top-10 ids they agree on, and the residual angles (u vs
the mapped v, degrees) say how far each map leaves the traffic queries from the old model's view.
It describes the change on real queries, which have no labels; it never decides the verdict.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from service.compat.curves import angle_stats
from service.compat.heads import transform_in_chunks
from service.compat.io import Split
from service.compat.metrics import KS, flip_rates, ranks, recall_at_k, relevance
from service.compat.procrustes import normalize_rows
from service.compat.profile import CompatProfile
from service.compat.uncertainty import describe, few_queries_line, paired_differences, summary
from service.errors import InputError
from service.rows import F32
from service.vocabulary import HeadFamily, Mode

P_WORSE = 0.025
# The share of queries the current profile answers at R@1 that a candidate may break.  A refit on more
# data moves about 1 % of them; 3 % of users seeing a right answer turn wrong is a visible regression.
MAX_NFR = 0.03
JUDGE = "recall@10"
EXIT_CODES = {"pass": 0, "fail": 1, "undecided": 3, "refused": 4}
TOP = 10
_CHUNK = 8192


def _queries(profile: CompatProfile, mode: str, old: F32, new: F32, modality: str) -> F32:
    """The profile's queries for `mode`."""
    return transform_in_chunks(profile, mode, old, new, modality).queries.astype(np.float32)


def _served_on(profile: CompatProfile, old: F32, new: F32, modality: str) -> tuple[F32, dict[str, float] | None]:
    """The profile's head queries, and the angle statistics between u and the mapped v (degrees) when it blends."""
    served = transform_in_chunks(profile, profile.head, old, new, modality)
    mode = next((m for m in (Mode.slerp, Mode.adapter_slerp) if m in profile.modes()), None)
    if mode is None:
        return served.queries.astype(np.float32), None
    blended = served if mode == profile.head else transform_in_chunks(profile, mode, old, new, modality)
    return served.queries.astype(np.float32), angle_stats(blended.theta)


def top_ids(queries: F32, targets: F32, k: int = TOP) -> npt.NDArray[np.int64]:
    """Row numbers of each query's top-k targets by inner product (exact, chunked)."""
    k = min(k, len(targets))
    t = torch.from_numpy(np.ascontiguousarray(targets))
    out = [
        torch.topk(torch.from_numpy(np.ascontiguousarray(queries[s : s + _CHUNK])) @ t.T, k, dim=1).indices.numpy()
        for s in range(0, len(queries), _CHUNK)
    ]
    return np.concatenate(out).astype(np.int64)


def _same_models(current: CompatProfile, candidate: CompatProfile) -> str | None:
    """Why the candidate cannot replace the current profile (other models or dims), or None."""
    for side in ("old", "new"):
        a = (getattr(current, f"{side}_model_id"), getattr(current, f"{side}_dim"))
        b = (getattr(candidate, f"{side}_model_id"), getattr(candidate, f"{side}_dim"))
        if a != b:
            return f"the candidate's {side} model is {b[0]} ({b[1]}-d), the current profile's {a[0]} ({a[1]}-d)"
        ours, theirs = (current.models or {}).get(side), (candidate.models or {}).get(side)
        if ours and theirs and ours.get("fingerprint") != theirs.get("fingerprint"):
            fingerprints = f"{theirs.get('fingerprint')} vs {ours.get('fingerprint')}"
            return f"the {side} model's weights differ between the profiles (fingerprint {fingerprints})"
    return None


def _modality(profile: CompatProfile, given: str | None) -> str:
    """The query modality to score: the given one, else the profile's only fitted one."""
    if given is not None:
        return given
    fitted = sorted(profile.params) or sorted(profile.alphas) or ["text"]
    if len(fitted) != 1:
        raise InputError(f"profile fits modalities {', '.join(fitted)}; pick one with --query-modality")
    return fitted[0]


def compare(
    current: CompatProfile,
    candidate: CompatProfile,
    test: Split,
    *,
    traffic: tuple[F32, F32] | None = None,
    modality: str | None = None,
    p_worse: float = P_WORSE,
    max_nfr: float = MAX_NFR,
    judge: str = JUDGE,
) -> dict[str, Any]:
    """Score both profiles' heads on `test` (and traffic, when given); the outcome and why, JSON-ready.

    traffic: (old, new) query rows of exported traffic, for the shadow agreement.
    """
    for name, p in (("current", current), ("candidate", candidate)):
        if p.family is HeadFamily.classes:
            raise InputError(f"the {name} profile is {p.head}: compare scores Procrustes and adapter heads")
    mismatch = _same_models(current, candidate)
    modality = _modality(current, modality)
    out: dict[str, Any] = {
        "test": str(test.path),
        "queries": len(test.old_query),
        "modality": modality,
        "p_worse": p_worse,
        "max_nfr": max_nfr,
        "judged_on": judge,
        "warning": few_queries_line(len(test.old_query), f"test set {test.path}"),
    }
    if mismatch is not None:
        out.update(outcome="refused", passed=False, reasons=[mismatch])
        return out
    targets = normalize_rows(test.old_target)
    rel = relevance(test.query_ids, test.target_ids)
    old_rank = ranks(_queries(current, "old", test.old_query, test.new_query, modality), targets, rel)
    rank: dict[str, npt.NDArray[np.int64]] = {}
    for name, p in (("current", current), ("candidate", candidate)):
        rank[name] = ranks(_queries(p, p.head, test.old_query, test.new_query, modality), targets, rel)
        rec = recall_at_k(rank[name], KS)
        pfr, nfr = flip_rates(old_rank < 1, rank[name] < 1)
        out[name] = {
            "profile_id": p.profile_id,
            "head": p.head,
            "alpha": p.alphas.get(modality),
            **{f"recall@{k}": rec[k] for k in KS},
            **summary(rank[name], old_rank, judge),
            "pfr": pfr,
            "nfr": nfr,
        }
    out["old"] = {f"recall@{k}": v for k, v in recall_at_k(old_rank, KS).items()}
    d = (rank["candidate"] < 1).astype(np.float64) - (rank["current"] < 1).astype(np.float64)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
    pfr, nfr = flip_rates(rank["current"] < 1, rank["candidate"] < 1)
    broken, fixed = int(np.sum(d < 0)), int(np.sum(d > 0))
    out["difference"] = {
        "recall@1": float(d.mean()),
        "se@1": se,
        "broken": broken,
        "fixed": fixed,
        "p_worse": sign_test_worse(broken, fixed),
        "pfr_vs_current": pfr,
        "nfr_vs_current": nfr,
        "vs_current": paired_differences(rank["candidate"], rank["current"]),
    }
    if traffic is not None:
        out["traffic"] = shadow(current, candidate, traffic, targets, modality)
    outcome, reasons = _outcome(out, judge)
    out.update(outcome=outcome, passed=outcome == "pass", reasons=reasons)
    return out


def _outcome(out: dict[str, Any], judge: str) -> tuple[str, list[str]]:
    """fail, undecided or pass, with the reasons (see the module docstring)."""
    cand, d = out["candidate"], out["difference"]
    verdicts = {judge: cand["compatible"], "recall@1": cand["compatible@1"]}
    reasons = [
        f"the candidate is worse than old->old beyond the noise at {metric}: "
        f"{describe(cand['vs_old'][metric])} points (95 % interval)"
        for metric, v in verdicts.items()
        if v == "not compatible"
    ]
    if d["p_worse"] < out["p_worse"]:
        reasons.append(
            f"the candidate is worse beyond the noise: it breaks {d['broken']} queries the current profile answers "
            f"at R@1 and fixes {d['fixed']} (R@1 {d['recall@1']:+.4f}); if they were equally good, a split this "
            f"uneven has probability {d['p_worse']:.2g} < {out['p_worse']:g}"
        )
    if d["nfr_vs_current"] > out["max_nfr"]:
        reasons.append(
            f"the candidate breaks {d['broken']} of {out['queries']} queries ({d['nfr_vs_current']:.1%}) that the "
            f"current profile answers at R@1, more than the {out['max_nfr']:.0%} allowed (--max-nfr): what users "
            "had would change for the worse, whatever it fixes"
        )
    if reasons:
        return "fail", reasons
    if "compatible" not in verdicts.values():
        where = "; ".join(f"{metric} {describe(cand['vs_old'][metric])}" for metric in verdicts)
        return "undecided", [
            f"not enough data to tell: on {out['queries']} queries the candidate's difference from old->old "
            f"(points, 95 % interval: {where}) spans 0 at both metrics; a larger test set decides"
        ]
    return "pass", []


def sign_test_worse(broken: int, fixed: int) -> float:
    """P(B >= broken) for B ~ Binomial(broken + fixed, 1/2): the exact one-sided McNemar p-value (1.0 when none)."""
    n = broken + fixed
    if n == 0 or broken == 0:
        return 1.0
    log_half = n * math.log(0.5)
    terms = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + log_half for k in range(broken, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def shadow(
    current: CompatProfile, candidate: CompatProfile, traffic: tuple[F32, F32], targets: F32, modality: str
) -> dict[str, Any]:
    """Overlap@10 of the two profiles' top-10 on traffic queries over `targets`, and their residual angles."""
    old, new = traffic
    if old.shape[1] != current.old_dim or new.shape[1] != current.new_dim:
        raise InputError(
            f"traffic pairs are {new.shape[1]} -> {old.shape[1]}, the profiles {current.new_dim} -> {current.old_dim}"
        )
    served = [_served_on(p, old, new, modality) for p in (current, candidate)]
    tops = [top_ids(queries, targets) for queries, _ in served]
    k = tops[0].shape[1]
    agree = np.array([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(tops[0], tops[1], strict=True)])
    return {
        "pairs": len(old),
        "gallery": f"the test split's {len(targets)} old targets",
        f"overlap@{TOP}": float(agree.mean()),
        f"overlap@{TOP}_p5": float(np.percentile(agree, 5)),
        "residual_angle_deg": {"current": served[0][1], "candidate": served[1][1]},
    }
