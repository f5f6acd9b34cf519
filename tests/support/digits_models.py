"""A small, real class-extension upgrade on sklearn's bundled digits (offline): two torch MLP classifiers.

OLD: trained on classes 0-4 only.  NEW: independently initialised, wider and deeper, trained on 0-9.
Both run on the CPU in about a second.  The module also scores a representation the way 001_... does:
retrieval with class-label relevance (mAP, and Recall@1 through service.compat.metrics) and the mean
margins of the two backward-compatibility inequalities (1a) / (1b) on cosine distances.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from sklearn.datasets import load_digits
from torch import nn

from service.compat.adapter import AdapterConfig, train_adapter
from service.compat.interpolation import slerp
from service.compat.metrics import is_compatible, relevance, search_recall
from service.compat.procrustes import align, fit_rotation, normalize_rows, pad
from service.compat.psp import ClassSpace, lsp_features, psp_features, query_features, softmax

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
OLD_CLASSES = 5
NEW_CLASSES = 10


@dataclass(frozen=True)
class Splits:
    """Row indices into the digits data: classifier training, adapter / map support, evaluation."""

    x: F32
    y: I64
    train: I64
    support: I64
    query: I64
    gallery: I64


def make_splits(seed: int, old_only_eval: bool = True) -> Splits:
    """Stratified 40 / 20 / 20 / 20 split: train, support, query, gallery (eval rows of classes 0-4 by default)."""
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[], [], [], []]
    for c in range(NEW_CLASSES):
        rows = rng.permutation(np.flatnonzero(y == c))
        cuts = np.round(np.array([0.4, 0.6, 0.8]) * len(rows)).astype(int)
        for part, chunk in zip(parts, np.split(rows, cuts), strict=True):
            part.extend(chunk.tolist())
    train, support, query, gallery = (np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
    if old_only_eval:
        query = query[y[query] < OLD_CLASSES]
        gallery = gallery[y[gallery] < OLD_CLASSES]
    return Splits(x, y, train, support, query, gallery)


class Classifier(nn.Module):
    """ReLU MLP: input -> hidden layers -> feature layer -> linear classifier."""

    def __init__(self, widths: list[int], classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits)."""
        f = self.body(x)
        return f, self.head(f)


def train_classifier(
    x: F32, y: I64, widths: list[int], classes: int, seed: int, epochs: int, lr: float = 3e-3
) -> Classifier:
    """Minibatch Adam with cross-entropy on one-hot labels, seeded (deterministic on CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Classifier(widths, classes)
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for rows in torch.split(torch.randperm(len(xt), generator=gen), 64):
                _, logits = model(xt[rows])
                loss = nn.functional.cross_entropy(logits, yt[rows])
                opt.zero_grad()
                torch.autograd.backward(loss)
                opt.step()
    return model.eval()


def encode(model: Classifier, x: F32) -> tuple[F32, F32]:
    """(features, logits) of rows x as float32 numpy."""
    with torch.inference_mode():
        f, z = model(torch.from_numpy(x))
    return f.numpy(), z.numpy()


@dataclass(frozen=True)
class Pair:
    """An (old, new) model pair with everything the experiment reads from them."""

    splits: Splits
    old: Classifier
    new: Classifier


OLD_PER_CLASS = 20
OLD_EPOCHS = 30
OLD_WIDTHS = [64, 32]


def train_pair(seed: int, old_only_eval: bool = True) -> Pair:
    """Train OLD (small, few images of classes 0-4) and NEW (larger, every training image of 0-9)."""
    s = make_splits(seed, old_only_eval)
    rng = np.random.default_rng(500 + seed)
    # The old model saw less data, as a deployed model usually has: OLD_PER_CLASS images per class.
    tr_old = np.concatenate([rng.permutation(s.train[s.y[s.train] == c])[:OLD_PER_CLASS] for c in range(OLD_CLASSES)])
    old = train_classifier(s.x[tr_old], s.y[tr_old], OLD_WIDTHS, OLD_CLASSES, seed=1000 + seed, epochs=OLD_EPOCHS)
    # The new model is larger and trained longer: a more concentrated (more confident) upgrade,
    # the setting the compatibility theorem of 001_... assumes.
    new = train_classifier(s.x[s.train], s.y[s.train], [64, 128, 96, 64], NEW_CLASSES, seed=2000 + seed, epochs=60)
    return Pair(s, old, new)


def mean_average_precision(queries: F32, gallery: F32, q_labels: I64, g_labels: I64) -> float:
    """mAP of inner-product ranking with class-label relevance (rows are L2-normalised here)."""
    scores = normalize_rows(queries) @ normalize_rows(gallery).T
    order = np.argsort(-scores, axis=1, kind="stable")
    rel = (g_labels[order] == q_labels[:, None]).astype(np.float64)
    hits = np.cumsum(rel, axis=1)
    precision = hits / np.arange(1, rel.shape[1] + 1)
    n_rel = np.maximum(rel.sum(axis=1), 1.0)
    return float(np.mean((precision * rel).sum(axis=1) / n_rel))


def recall_at_1(queries: F32, gallery: F32, q_labels: I64, g_labels: I64) -> float:
    """Recall@1 with class-label relevance, through the shared metrics module."""
    return search_recall(queries, gallery, relevance(q_labels, g_labels), ks=(1,))[1]


def compatibility_margins(new_q: F32, old_q: F32, gallery: F32, q_labels: I64, g_labels: I64) -> tuple[float, float]:
    """Mean margins of (1a) and (1b) on cosine distance 1 - cos; positive = the inequality holds on average.

    (1a): same-class pairs, old->old distance minus new->old distance.
    (1b): different-class pairs, new->old distance minus old->old distance.
    """
    g = normalize_rows(gallery).astype(np.float64)
    d_new = 1.0 - normalize_rows(new_q).astype(np.float64) @ g.T
    d_old = 1.0 - normalize_rows(old_q).astype(np.float64) @ g.T
    same = q_labels[:, None] == g_labels[None, :]
    m_1a = float(np.mean(d_old[same] - d_new[same]))
    m_1b = float(np.mean(d_new[~same] - d_old[~same]))
    return m_1a, m_1b


@dataclass(frozen=True)
class Row:
    """One representation scored new->old against its own old->old baseline."""

    method: str
    map_new_old: float
    map_old_old: float
    r1_new_old: float
    r1_old_old: float
    margin_1a: float
    margin_1b: float

    @property
    def compatible(self) -> bool:
        """The empirical criterion of 001_... on mAP: new->old strictly above old->old."""
        return is_compatible(self.map_new_old, self.map_old_old)


def score(method: str, new_q: F32, old_q: F32, gallery: F32, q_labels: I64, g_labels: I64) -> Row:
    """All metrics of one representation (query rows from both models, gallery rows from OLD)."""
    return Row(
        method,
        mean_average_precision(new_q, gallery, q_labels, g_labels),
        mean_average_precision(old_q, gallery, q_labels, g_labels),
        recall_at_1(new_q, gallery, q_labels, g_labels),
        recall_at_1(old_q, gallery, q_labels, g_labels),
        *compatibility_margins(new_q, old_q, gallery, q_labels, g_labels),
    )


def _blend(u_old: F32, v_new: F32, r: F32, alpha: float) -> F32:
    """Procrustes + SLERP as the service does it: blend in the padded space, keep the old coordinates."""
    d_old = u_old.shape[1]
    u = pad(normalize_rows(u_old), r.shape[0])
    v = align(v_new, r, d_old)
    return normalize_rows(slerp(u, v, alpha)[:, :d_old])


def pick_alpha(new_s: F32, old_s: F32, labels: I64, seed: int, eval_mask: npt.NDArray[np.bool_]) -> float:
    """Alpha on the support set, cross-fitted once: R on one half, alpha scored (mAP) on the other."""
    rng = np.random.default_rng(seed)
    half = rng.permutation(len(new_s)) < len(new_s) // 2
    r = fit_rotation(new_s[half], old_s[half])
    held = np.flatnonzero(~half & eval_mask)
    q_rows, g_rows = held[::2], held[1::2]
    best, best_alpha = -1.0, 0.0
    for alpha in np.linspace(0.0, 1.0, 11):
        q = _blend(old_s[q_rows], new_s[q_rows], r, float(alpha))
        m = mean_average_precision(q, old_s[g_rows], labels[q_rows], labels[g_rows])
        if m > best + 1e-12:  # ties keep the smaller alpha (closer to the old system)
            best, best_alpha = m, float(alpha)
    return best_alpha


def run_experiment(seed: int, old_only_eval: bool = True) -> tuple[list[Row], dict[str, float]]:
    """Train one model pair and score every representation of the table; also return fitted knobs."""
    pair = train_pair(seed, old_only_eval)
    s = pair.splits
    f_old_q, z_old_q = encode(pair.old, s.x[s.query])
    f_new_q, z_new_q = encode(pair.new, s.x[s.query])
    f_old_g, z_old_g = encode(pair.old, s.x[s.gallery])
    f_old_s, _ = encode(pair.old, s.x[s.support])
    f_new_s, _ = encode(pair.new, s.x[s.support])
    yq, yg = s.y[s.query], s.y[s.gallery]
    k, t = OLD_CLASSES, NEW_CLASSES

    def padded(a: F32, d: int) -> F32:
        return pad(normalize_rows(a), d)

    def without_p_tk(method: str, features: Callable[[F32], F32]) -> Row:
        """The new model's class features as they are, the old model's zero-padded to the new model's C_t classes."""
        return score(method, features(z_new_q), padded(features(z_old_q), t), padded(features(z_old_g), t), yq, yg)

    def head(method: str, features: Callable[[F32], F32], space: ClassSpace) -> Row:
        """The head's query features (the new model's, through P_tk) against the old model's own class features."""
        return score(method, query_features(z_new_q, k, space), features(z_old_q), features(z_old_g), yq, yg)

    sm_new, sm_old_q, sm_old_g = (softmax(z).astype(np.float32) for z in (z_new_q, z_old_q, z_old_g))
    d_feat = max(f_new_q.shape[1], f_old_q.shape[1])
    rows = [
        score(
            "penultimate features", padded(f_new_q, d_feat), padded(f_old_q, d_feat), padded(f_old_g, d_feat), yq, yg
        ),
        score("softmax", sm_new, padded(sm_old_q, t), padded(sm_old_g, t), yq, yg),
        without_p_tk("PSP without P_tk", psp_features),
        score(
            "PSP without P_kk",
            normalize_rows(sm_new[:, :k]),
            normalize_rows(sm_old_q),
            normalize_rows(sm_old_g),
            yq,
            yg,
        ),
        head("PSP", psp_features, "psp"),
        without_p_tk("LSP without P_tk", lsp_features),
        head("LSP", lsp_features, "lsp"),
    ]
    eval_mask = s.y[s.support] < OLD_CLASSES if old_only_eval else np.ones(len(s.support), dtype=bool)
    alpha = pick_alpha(f_new_s, f_old_s, s.y[s.support], seed, eval_mask)
    r = fit_rotation(f_new_s, f_old_s)
    rows.append(score("Procrustes (aligned)", _blend(f_old_q, f_new_q, r, 1.0), f_old_q, f_old_g, yq, yg))
    rows.append(
        score(f"Procrustes + SLERP a={alpha:.1f}", _blend(f_old_q, f_new_q, r, alpha), f_old_q, f_old_g, yq, yg)
    )
    adapter = train_adapter(f_new_s, f_old_s, ADAPTER_CONFIG, progress=False)
    rows.append(score("MKP adapter", adapter.apply(f_new_q), f_old_q, f_old_g, yq, yg))
    return rows, {"alpha": alpha, "adapter_seconds": float(adapter.report["seconds"])}


# fp32 keeps the table identical across CPUs (bf16 autocast depends on the hardware); the nets are tiny.
ADAPTER_CONFIG = AdapterConfig(epochs=100, batch_size=128, m=32, seed=0, precision="fp32")


@dataclass(frozen=True)
class Summary:
    """One method over several model pairs: mean metrics and how many pairs meet each criterion."""

    method: str
    pairs: int
    map_new_old: float
    map_old_old: float
    r1_new_old: float
    r1_old_old: float
    compatible: int
    margin_1a: float
    margin_1b: float
    holds_1a: int
    holds_1b: int
    holds_both: int


def summarise(tables: list[list[Row]]) -> list[Summary]:
    """Aggregate per-pair rows (same methods, same order) into one Summary per method."""
    out = []
    for i, first in enumerate(tables[0]):
        rows = [t[i] for t in tables]
        method = first.method.split(" a=")[0]  # the chosen alpha differs per pair
        out.append(
            Summary(
                method,
                len(rows),
                float(np.mean([r.map_new_old for r in rows])),
                float(np.mean([r.map_old_old for r in rows])),
                float(np.mean([r.r1_new_old for r in rows])),
                float(np.mean([r.r1_old_old for r in rows])),
                sum(r.compatible for r in rows),
                float(np.mean([r.margin_1a for r in rows])),
                float(np.mean([r.margin_1b for r in rows])),
                sum(r.margin_1a > 0 for r in rows),
                sum(r.margin_1b > 0 for r in rows),
                sum(r.margin_1a > 0 and r.margin_1b > 0 for r in rows),
            )
        )
    return out


def format_table(summaries: list[Summary]) -> str:
    """Markdown table of `summarise` output; margins are x 1e-3, counts are pairs out of all pairs."""
    head = (
        "| method | mAP new->old | mAP old->old | R@1 new->old | R@1 old->old | compatible (mAP) "
        "| margin 1a (e-3) | margin 1b (e-3) | 1a and 1b hold |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [
        f"| {s.method} | {s.map_new_old:.4f} | {s.map_old_old:.4f} | {s.r1_new_old:.4f} | {s.r1_old_old:.4f} "
        f"| {s.compatible}/{s.pairs} | {1e3 * s.margin_1a:+.1f} | {1e3 * s.margin_1b:+.1f} | {s.holds_both}/{s.pairs} |"
        for s in summaries
    ]
    return "\n".join([head, *lines])
