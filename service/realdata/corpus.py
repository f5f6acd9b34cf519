"""The real corpus: docstring pairs of the project's own dependencies, filtered, de-duplicated and split.

    DEFAULT_PACKAGES --docstrings.py--> (query, target) --reject_reason--> kept --first wins--> unique pairs
    unique pairs --seeded shuffle--> support (fit) | test (queries; their targets go to the gallery) | distractors

Why these packages: they are the project's dependencies and those of its `models` / `dev` extras (scipy
comes with scikit-learn and sentence-transformers), so they exist wherever the project is installed,
and nothing is generated.  A missing one is skipped and reported.  The pairs are a pure function of
the installed versions (recorded in corpus.json) and the seed.

Pair ids are positions in the unique list (before the shuffle), so a docstring keeps its id whatever
the seed and the sizes; test target ids are gallery ids.  Duplicates are decided on a normalised key
(lower case, words only), the first occurrence in package order winning, so that no query and no
target text occurs twice anywhere (a duplicated target would make two gallery items indistinguishable,
and one shared between support and test would leak the test into the fit); targets that merely open
alike (OPENING_WORDS) count as duplicates too.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.errors import InputError
from service.realdata.docstrings import package_docstrings, package_files

# Import names, in priority order (the first package to document a text keeps it).
DEFAULT_PACKAGES = (
    "numpy",
    "scipy",
    "sklearn",
    "torch",
    "transformers",
    "sentence_transformers",
    "matplotlib",
    "pydantic",
    "fastapi",
    "httpx",
    "redis",
    "rich",
    "typer",
    "PIL",
    "hypothesis",
    "locust",
    "faiss",
    "model2vec",
    "tqdm",
)
# A summary of fewer words is a label ("Return the value."), not a question anyone would ask; one of
# more than 40 is the whole description run into the first paragraph.  A description under 8 words
# says too little to be found by meaning.
MIN_QUERY_WORDS = 4
MAX_QUERY_WORDS = 40
MIN_TARGET_WORDS = 8
# Targets that open with the same 12 words are boilerplate shared by many docstrings ("reverse=True
# means self is the right hand operand ...", 12 dunder-like methods) or one description copied onto
# sibling functions: near-duplicates in the gallery that no model could tell apart.  The first is kept.
OPENING_WORDS = 12

_WORD_RE = re.compile(r"\w+")
# "For more information, see https://redis.io/commands/zcount" is a link, not a description: a URL's
# pieces do not count as words.
_URL_RE = re.compile(r"\bhttps?://\S+")


@dataclass(frozen=True)
class Pair:
    """A kept docstring pair: its id (position among the unique pairs), origin, query and target."""

    id: int
    package: str
    source: str
    query: str
    target: str


@dataclass
class PackageCount:
    """What one package gave: installed version, docstring pairs found, pairs kept after filters and dedup."""

    version: str | None
    found: int = 0
    kept: int = 0


@dataclass
class Collected:
    """The unique pairs of all packages, with per-package counts and why the others were dropped."""

    pairs: list[Pair]
    packages: dict[str, PackageCount]
    missing: list[str]
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Split:
    """Disjoint parts of the unique pairs: support (fit), test (queries) and distractors (gallery only)."""

    support: list[Pair]
    test: list[Pair]
    distractors: list[Pair]

    def gallery(self) -> list[Pair]:
        """Test and distractor pairs, by id: their targets are the gallery."""
        return sorted([*self.test, *self.distractors], key=lambda p: p.id)


def words(text: str) -> list[str]:
    """Lower-case words of `text` (letters, digits, underscore)."""
    return _WORD_RE.findall(text.lower())


def reject_reason(query: str, target: str) -> str | None:
    """Why the pair is not kept (`short_query`, `long_query`, `short_target`, `repeats_query`), or None.

    Duplicates are collect's business: they depend on what came before.
    """
    q, t = words(query), words(_URL_RE.sub(" ", target))
    if len(q) < MIN_QUERY_WORDS:
        return "short_query"
    if len(q) > MAX_QUERY_WORDS:
        return "long_query"
    if len(t) < MIN_TARGET_WORDS:
        return "short_target"
    # A target that only restates the query (plus a few words) is matched by wording, not by meaning.
    if " ".join(q) in " ".join(t) and len(t) - len(q) < MIN_TARGET_WORDS:
        return "repeats_query"
    return None


def collect(packages: Sequence[str] = DEFAULT_PACKAGES) -> Collected:
    """The unique, acceptable pairs of the installed `packages`, in package then sorted-file order."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    distributions = packages_distributions()
    pairs: list[Pair] = []
    counts: dict[str, PackageCount] = {}
    missing: list[str] = []
    dropped: dict[str, int] = {}
    seen_queries: set[str] = set()
    seen_targets: set[str] = set()
    seen_openings: set[str] = set()
    for name in packages:
        if package_files(name) is None:
            missing.append(name)
            continue
        try:
            dist_version = version(distributions.get(name, [name])[0])
        except PackageNotFoundError:
            dist_version = None
        count = PackageCount(dist_version)
        for doc in package_docstrings(name):
            count.found += 1
            reason = reject_reason(doc.query, doc.target)
            q_key, t_words = " ".join(words(doc.query)), words(doc.target)
            t_key, opening = " ".join(t_words), " ".join(t_words[:OPENING_WORDS])
            if reason is None and q_key in seen_queries:
                reason = "duplicate_query"
            if reason is None and t_key in seen_targets:
                reason = "duplicate_target"
            if reason is None and opening in seen_openings:
                reason = "near_duplicate_target"
            if reason is not None:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            seen_queries.add(q_key)
            seen_targets.add(t_key)
            seen_openings.add(opening)
            pairs.append(Pair(len(pairs), name, doc.source, doc.query, doc.target))
            count.kept += 1
        counts[name] = count
    return Collected(pairs, counts, missing, dropped)


def split(pairs: Sequence[Pair], *, support: int, test: int, distractors: int | None, seed: int) -> Split:
    """Shuffle `pairs` with `seed` and cut support, test and up to `distractors` pairs (None: all the rest)."""
    if support < 1 or test < 1 or (distractors is not None and distractors < 0):
        raise InputError("support and test sizes must be >= 1 and distractors >= 0")
    if support + test > len(pairs):
        raise InputError(
            f"the installed packages give {len(pairs):,} pairs, fewer than --support {support:,} + --test {test:,}"
        )
    order = list(range(len(pairs)))
    # random.Random's shuffle is stable across Python versions and platforms for a given seed.
    random.Random(seed).shuffle(order)
    shuffled = [pairs[i] for i in order]
    rest = shuffled[support + test :]
    return Split(
        support=shuffled[:support],
        test=shuffled[support : support + test],
        distractors=rest if distractors is None else rest[:distractors],
    )
