"""`nobackfill profile compare` without the CLI: the rollout gate between the served profile and a candidate.

Both profiles serve their own head (the mode the service answers with by default) on one labelled
test split, by exact search against its old targets, exactly as `eval` scores them: R@1/5/10,
`compatible` (R@1 strictly above old->old) and PFR / NFR against old->old, plus the flips between
the two profiles.

The noise rule.  Both profiles answer the same queries, so the comparison is paired and only the
queries they disagree on at R@1 carry information: b = queries the candidate breaks (current hit,
candidate miss), c = queries it fixes.  If the two were equally good, each of those b + c queries
would fall either way with probability 1/2, so b ~ Binomial(b + c, 1/2) (the exact one-sided
McNemar / sign test).  The candidate is worse beyond the noise when P(B >= b) < P_WORSE (2.5 %).
It passes when it is compatible, serves the same two models, and is not worse beyond the noise.
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

from service.compat.heads import transform_in_chunks
from service.compat.io import Split
from service.compat.metrics import KS, flip_rates, is_compatible, ranks, recall_at_k, relevance
from service.compat.procrustes import normalize_rows
from service.compat.profile import CompatProfile
from service.compat.selection import angle_stats
from service.errors import InputError
from service.vocabulary import HeadFamily, Mode

P_WORSE = 0.025
TOP = 10
_CHUNK = 8192
F32 = npt.NDArray[np.float32]


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
) -> dict[str, Any]:
    """Score both profiles' heads on `test` (and traffic, when given); the verdict and why, JSON-ready.

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
    }
    if mismatch is not None:
        out.update(passed=False, reasons=[mismatch])
        return out
    targets = normalize_rows(test.old_target)
    rel = relevance(test.query_ids, test.target_ids)
    old_rank = ranks(_queries(current, "old", test.old_query, test.new_query, modality), targets, rel)
    old_r1 = recall_at_k(old_rank, KS)[1]
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
            "compatible": is_compatible(rec[1], old_r1),
            "pfr": pfr,
            "nfr": nfr,
        }
    out["old"] = {f"recall@{k}": v for k, v in recall_at_k(old_rank, KS).items()}
    d = (rank["candidate"] < 1).astype(np.float64) - (rank["current"] < 1).astype(np.float64)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
    pfr, nfr = flip_rates(rank["current"] < 1, rank["candidate"] < 1)
    broken, fixed = int(np.sum(d < 0)), int(np.sum(d > 0))
    p_value = sign_test_worse(broken, fixed)
    out["difference"] = {
        "recall@1": float(d.mean()),
        "se@1": se,
        "broken": broken,
        "fixed": fixed,
        "p_worse": p_value,
        "pfr_vs_current": pfr,
        "nfr_vs_current": nfr,
    }
    reasons = []
    if not out["candidate"]["compatible"]:
        reasons.append(
            f"the candidate is not compatible: R@1 {out['candidate']['recall@1']:.4f} "
            f"is not above old->old {old_r1:.4f}"
        )
    if p_value < p_worse:
        reasons.append(
            f"the candidate is worse beyond the noise: it breaks {broken} queries the current profile answers at "
            f"R@1 and fixes {fixed} (R@1 {float(d.mean()):+.4f}); if they were equally good, a split this uneven "
            f"has probability {p_value:.2g} < {p_worse:g}"
        )
    if traffic is not None:
        out["traffic"] = shadow(current, candidate, traffic, targets, modality)
    out.update(passed=not reasons, reasons=reasons)
    return out


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
