"""What every store's client wrapper and cut-over check share: index/base.py's store_errors, in_store.py's
cut_over_label and refuse_unless_every_row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.errors import ArtifactError, GalleryUnavailable, InputError
from service.index.base import store_errors
from service.segment.in_store import cut_over_label, refuse_unless_every_row


def test_a_client_error_becomes_one_503_line_with_its_cause() -> None:
    cause = ConnectionError("connection refused\n  at some frame")
    with pytest.raises(GalleryUnavailable) as raised, store_errors("Qdrant did not answer for x"):
        raise cause
    assert str(raised.value) == "Qdrant did not answer for x: connection refused"
    assert raised.value.__cause__ is cause


def test_the_services_own_errors_pass_as_they_are() -> None:
    with pytest.raises(ArtifactError, match="another model"), store_errors("unused"):
        raise ArtifactError("another model")


def test_a_silent_client_error_is_named_by_its_class() -> None:
    with (
        pytest.raises(GalleryUnavailable, match="^cannot reach Milvus: TimeoutError$"),
        store_errors("cannot reach Milvus"),
    ):
        raise TimeoutError()


def test_the_cut_over_needs_a_labelled_part() -> None:
    label = SimpleNamespace(gallery="abc")
    assert cut_over_label(SimpleNamespace(label=label), "here", "vector", InputError) is label
    with pytest.raises(InputError, match="^here: no nobackfill vector to cut over to$"):
        cut_over_label(None, "here", "vector", InputError)
    with pytest.raises(ArtifactError, match="^here: no nobackfill segment to cut over to$"):
        cut_over_label(SimpleNamespace(label=None), "here", "segment", ArtifactError)


def test_the_cut_over_needs_every_row() -> None:
    refuse_unless_every_row("here", 10, 10, "rows", "then", InputError)
    with pytest.raises(ArtifactError) as raised:
        refuse_unless_every_row("here", 1_000, 4_000, "points", "wait", ArtifactError, whose="the collection's ")
    assert str(raised.value) == "here holds 1,000 of the collection's 4,000 points (25.0%); wait"
