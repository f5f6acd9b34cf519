"""Runtime `onnx` on the real all-MiniLM-L6-v2: its fp32 export agrees with torch on 1,000 real texts, and it
runs in an encoder child process (`isolation: process`, what `auto` gives a sentence-transformers model).

The texts are the docstring (query, target) pairs of numpy and scipy (service/realdata, what the real
corpus is built from): 950 one-line queries and 50 paragraphs of up to 600 characters.  About 30 s on
2 cores: one export (~10 s), the two encodes (~12 s), one child start.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from service.encoders.onnx_export import export_model  # noqa: E402
from service.encoders.process import ProcessEncoder, isolation_of  # noqa: E402
from service.encoders.registry import create_encoder, identity_of  # noqa: E402
from service.errors import NobackfillError  # noqa: E402
from service.realdata.docstrings import package_docstrings  # noqa: E402
from service.settings import EncoderSettings  # noqa: E402
from tests.support.tiny_models import packaged_minilm  # noqa: E402

BACKEND = "sentence-transformers"
# The real model end to end (about 40 s): `make test-scale` runs it; make test has the tiny-model checks.
pytestmark = [pytest.mark.slow, pytest.mark.scale]


def real_texts() -> list[str]:
    """950 docstring queries and 50 docstring paragraphs of numpy and scipy."""
    pairs = list(itertools.islice(itertools.chain(package_docstrings("numpy"), package_docstrings("scipy")), 1000))
    assert len(pairs) == 1000
    return [pair.query for pair in pairs[:950]] + [pair.target for pair in pairs[950:]]


@pytest.fixture(scope="module")
def minilm_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM's fp32 ONNX export."""
    out = tmp_path_factory.mktemp("minilm") / "fp32"
    export_model(packaged_minilm(), out)
    return out


def settings(onnx_dir: Path | None = None) -> EncoderSettings:
    """MiniLM on CPU, one thread; runtime onnx over onnx_dir when given."""
    runtime = {"runtime": "onnx", "onnx_dir": str(onnx_dir)} if onnx_dir else {}
    return EncoderSettings.model_validate(
        {"backend": BACKEND, "path": str(packaged_minilm()), "device": "cpu", "threads": 1, **runtime}
    )


@pytest.fixture(scope="module")
def child(minilm_fp32: Path) -> Iterator[ProcessEncoder]:
    """MiniLM's fp32 export served by an encoder child process."""
    encoder = ProcessEncoder(settings(minilm_fp32), "new")
    yield encoder
    encoder.close()


def test_fp32_export_matches_torch_within_1e_4_cosine_on_1000_real_texts(minilm_fp32: Path) -> None:
    texts = real_texts()
    torch_rows = create_encoder(settings(), "new").encode(texts)
    onnx_rows = create_encoder(settings(minilm_fp32), "new").encode(texts)
    cosines = (torch_rows * onnx_rows).sum(axis=1)
    assert cosines.min() >= 1 - 1e-4, (cosines.min(), texts[int(cosines.argmin())])


def test_the_export_runs_in_an_encoder_child_with_the_torch_identity(minilm_fp32: Path, child: ProcessEncoder) -> None:
    assert isolation_of(settings(minilm_fp32)) == "process"
    texts = real_texts()[945:955]  # queries and paragraphs
    local = create_encoder(settings(minilm_fp32), "new")
    np.testing.assert_allclose(child.encode(texts), local.encode(texts), atol=1e-6)
    assert child.details()["runtime"] == "onnx" and child.details()["precision"] == "fp32"
    assert (child.model_id, child.dim, child.fingerprint) == (
        local.model_id,
        384,
        identity_of(local, BACKEND).fingerprint,
    )


def test_a_child_given_an_export_of_another_model_refuses_to_start_in_one_line(
    minilm_fp32: Path, tmp_path: Path
) -> None:
    # A folder with other weight bytes: another fingerprint, refused before anything would load it.
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"not MiniLM")
    wrong = settings(minilm_fp32).model_copy(update={"path": str(other)})
    with pytest.raises(NobackfillError, match="was made from another model") as refused:
        ProcessEncoder(wrong, "new")
    assert "\n" not in refused.value.message
