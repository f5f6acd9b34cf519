"""The real encoder backends on real weights and tiny random models: loading, output, refusals, threads, plug-ins."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from service import metrics
from service.encoders.base import describe, fingerprint_of, modalities_of
from service.encoders.batcher import MicroBatcher
from service.encoders.identity import weights_fingerprint
from service.encoders.registry import ENTRY_POINT_GROUP, backends, create_encoder
from service.encoders.sentence_transformers import runs_directly
from service.encoders.torch_runtime import unit_rows
from service.errors import InputError
from service.settings import EncoderSettings
from tests.support.servers import serve_process
from tests.support.tiny_models import CLIP_DIM, CLIP_TEXT_POSITIONS, packaged_minilm, tiny_clip, tiny_static
from tests.support.world import World

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def png_b64(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> str:
    """A solid-colour image file, base64-encoded as the API's image_b64."""
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def minilm() -> Any:
    """The packaged all-MiniLM-L6-v2 through backend sentence-transformers, one CPU thread."""
    return create_encoder(
        EncoderSettings(backend="sentence-transformers", path=str(packaged_minilm()), threads=1), "new"
    )


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random CLIP saved with save_pretrained."""
    return tiny_clip(tmp_path_factory.mktemp("models") / "tiny-clip")


def test_minilm_gives_unit_rows_that_rank_a_paraphrase_first(minilm: Any) -> None:
    rows = minilm.encode(
        [
            "Compute the arithmetic mean along the specified axis.",
            "Return the average of the array elements over the given axis.",
            "Open a file and return a stream.",
        ]
    )
    assert rows.dtype == np.float32 and rows.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    assert rows[0] @ rows[1] > rows[0] @ rows[2] + 0.3


def test_minilm_identity_and_info(minilm: Any) -> None:
    assert (minilm.model_id, minilm.dim, minilm.device) == ("model", 384, "cpu")
    assert fingerprint_of(minilm) == weights_fingerprint(packaged_minilm())
    info = describe(minilm)
    assert info["max_seq_length"] == 256 and "truncated" in info["truncation"]
    assert info["modalities"] == ["text"] and info["dtype"] == "float32" and info["threads"] == 1


def test_cpu_bf16_runs_minilm_in_bfloat16_and_its_rows_agree_with_float32(minilm: Any) -> None:
    bf16 = create_encoder(
        EncoderSettings(backend="sentence-transformers", path=str(packaged_minilm()), threads=1, cpu_bf16=True), "new"
    )
    assert describe(bf16)["dtype"] == "bfloat16" and next(bf16.model.parameters()).dtype == torch.bfloat16
    texts = [
        "Compute the arithmetic mean along the specified axis.",
        "Return a new array of given shape and type, filled with zeros.",
        "Open a file and return a stream.",
    ]
    rows, exact = bf16.encode(texts), minilm.encode(texts)
    assert rows.dtype == np.float32 and rows.shape == exact.shape
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    cosines = (rows * exact).sum(axis=1)
    assert cosines.min() > 0.999 and not np.array_equal(rows, exact)  # close, and really computed in bfloat16


def test_minilm_runs_a_batch_as_length_sorted_passes_and_keeps_the_order(minilm: Any) -> None:
    texts = [f"{'numpy arrays and their reductions ' * (1 + (7 * i) % 9)}item {i}" for i in range(11)]
    assert minilm.forward_batch_size == 4 and describe(minilm)["forward_batch_size"] == 4
    passes: list[int] = []
    hook = minilm.model[0].register_forward_hook(lambda _m, args, _out: passes.append(len(args[0]["input_ids"])))
    try:
        batched = minilm.encode(texts)  # passes of <= 4 texts, sorted by length, rows back in input order
    finally:
        hook.remove()
    assert passes == [4, 4, 3]
    alone = np.concatenate([minilm.encode([text]) for text in texts])
    np.testing.assert_allclose(batched, alone, atol=1e-4)
    one_pass = EncoderSettings(
        backend="sentence-transformers", path=str(packaged_minilm()), threads=1, cpu_forward_batch_size=0
    )
    assert describe(create_encoder(one_pass, "new"))["forward_batch_size"] is None


def library_rows(encoder: Any, texts: list[str]) -> np.ndarray:
    """The rows SentenceTransformer.encode gives for `texts` in the encoder's passes, made unit as the backend does."""
    with encoder.runtime.run():
        return unit_rows(
            encoder.model.encode(
                texts,
                batch_size=encoder.forward_batch_size or len(texts),
                convert_to_tensor=True,
                show_progress_bar=False,
            )
        )


def test_minilm_runs_its_passes_without_encode_and_gives_its_rows_bit_for_bit(minilm: Any) -> None:
    texts = [f"{'numpy arrays and their reductions ' * (1 + (5 * i) % 7)}item {i}" for i in range(11)]
    assert minilm.direct  # no prompt, no truncation dimension: preprocess + forward, not encode
    calls: list[int] = []
    original = minilm.model.encode
    minilm.model.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        rows = minilm.encode(texts)
    finally:
        del minilm.model.encode  # the instance attribute shadowed the class's method
    assert calls == []
    np.testing.assert_array_equal(rows, library_rows(minilm, texts))


def test_a_model_with_a_default_prompt_or_a_truncation_goes_through_encode(minilm: Any) -> None:
    model = minilm.model
    assert runs_directly(model)
    prompts, default = dict(model.prompts), model.default_prompt_name
    try:
        model.prompts, model.default_prompt_name = {**prompts, "query": "query: "}, "query"
        assert not runs_directly(model)  # encode prepends the prompt: only encode gives its rows
        model.default_prompt_name = None
        model.truncate_dim = 128
        assert not runs_directly(model)
    finally:
        model.prompts, model.default_prompt_name, model.truncate_dim = prompts, default, None
    assert runs_directly(model)


def test_minilm_truncates_long_text_instead_of_failing(minilm: Any) -> None:
    short = "numpy arrays and their reductions " * 40  # ~240 tokens: under the limit
    long = short * 5  # ~1,200 tokens: cut at 256
    rows = minilm.encode([short, long, short + " tail words that fall past the cut " * 60])
    assert np.isfinite(rows).all()
    # Past 256 tokens the extra words are never seen: the two long inputs share their first 256 tokens.
    assert rows[1] @ rows[2] > 0.999


def test_text_only_backend_refuses_images(minilm: Any) -> None:
    assert modalities_of(minilm) == ("text",)
    with pytest.raises(InputError, match="encodes text only"):
        minilm.encode([png_b64((1, 2, 3))], "image")


def test_model_id_setting_overrides_the_folder_name(tmp_path: Path) -> None:
    folder = tiny_static(tmp_path / "static-24")
    named = create_encoder(
        EncoderSettings(backend="sentence-transformers", path=str(folder), model_id="lexical-v1"), "old"
    )
    plain = create_encoder(EncoderSettings(backend="sentence-transformers", path=str(folder)), "old")
    assert (named.model_id, plain.model_id) == ("lexical-v1", "static-24")
    assert named.dim == 24 and describe(plain)["max_seq_length"] is None
    assert describe(plain)["forward_batch_size"] is None  # a static model pads nothing: one pass per batch


def test_static_model_gives_zero_not_nan_for_text_without_tokens(tmp_path: Path) -> None:
    encoder = create_encoder(
        EncoderSettings(backend="sentence-transformers", path=str(tiny_static(tmp_path / "s"))), "old"
    )
    rows = encoder.encode(["a sentence with known words", ""])
    assert np.isfinite(rows).all()
    assert np.linalg.norm(rows[0]) == pytest.approx(1.0, abs=1e-5)
    assert not rows[1].any()
    assert encoder.direct  # and what preprocess + forward gave is what encode gives
    np.testing.assert_array_equal(rows, library_rows(encoder, ["a sentence with known words", ""]))


def test_clip_encodes_text_and_images(clip_dir: Path) -> None:
    encoder = create_encoder(EncoderSettings(backend="clip", path=str(clip_dir)), "new")
    encoder.warmup()
    assert (encoder.dim, modalities_of(encoder)) == (CLIP_DIM, ("text", "image"))
    images = encoder.encode(
        [png_b64((255, 0, 0)), png_b64((255, 0, 0), (64, 48), "JPEG"), png_b64((0, 0, 255))], "image"
    )
    texts = encoder.encode(["a red square", "a blue circle"], "text")
    for rows in (images, texts):
        assert rows.dtype == np.float32 and rows.shape[1] == CLIP_DIM
        np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    assert images[0] @ images[1] > images[0] @ images[2]  # the same colour survives resizing and JPEG
    info = describe(encoder)
    assert info["backend"] == "clip" and info["max_seq_length"] == CLIP_TEXT_POSITIONS


def test_cpu_bf16_serves_clip_text_and_images_and_a_static_model(clip_dir: Path, tmp_path: Path) -> None:
    clip = create_encoder(EncoderSettings(backend="clip", path=str(clip_dir), cpu_bf16=True), "new")
    exact = create_encoder(EncoderSettings(backend="clip", path=str(clip_dir)), "new")
    assert describe(clip)["dtype"] == "bfloat16"
    for items, modality in (([png_b64((255, 0, 0)), png_b64((0, 0, 255))], "image"), (["a red square"], "text")):
        rows = clip.encode(items, modality)
        assert rows.dtype == np.float32 and np.isfinite(rows).all()
        assert ((rows * exact.encode(items, modality)).sum(axis=1) > 0.99).all()
    static = create_encoder(
        EncoderSettings(backend="sentence-transformers", path=str(tiny_static(tmp_path / "s")), cpu_bf16=True), "old"
    )
    rows = static.encode(["a sentence with known words", ""])
    assert describe(static)["dtype"] == "bfloat16"
    assert np.linalg.norm(rows[0]) == pytest.approx(1.0, abs=1e-5) and not rows[1].any()


def test_clip_truncates_text_at_its_position_limit(clip_dir: Path) -> None:
    encoder = create_encoder(EncoderSettings(backend="clip", path=str(clip_dir)), "new")
    words = "alpha beta gamma delta " * 20  # far past the 24 positions of the tiny text tower
    rows = encoder.encode([words, words + "omega " * 30], "text")
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-6)


def test_clip_refuses_what_is_not_an_image(clip_dir: Path) -> None:
    encoder = create_encoder(EncoderSettings(backend="clip", path=str(clip_dir)), "new")
    with pytest.raises(InputError, match="image 1 is not a readable image"):
        encoder.encode([png_b64((0, 0, 0)), base64.b64encode(b"not an image").decode()], "image")
    with pytest.raises(InputError, match="image 0 is not valid base64"):
        encoder.encode(["%%%"], "image")


async def test_a_text_past_the_token_limit_and_an_undecodable_image_cost_their_batch_mates_nothing(
    clip_dir: Path,
) -> None:
    # Each call is submitted in the same tick, so the three texts share one batch and so do the three images.
    encoder = create_encoder(EncoderSettings(backend="clip", path=str(clip_dir)), "new")
    batcher = MicroBatcher(encoder, 32, 50.0, name="clip-isolation")
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    noise.save(buffer, format="JPEG")
    truncated = base64.b64encode(buffer.getvalue()[:-200]).decode()  # its header reads, its pixels do not
    texts = ["alpha beta gamma delta " * 89, "a red square", "a blue circle"]  # 2,047 characters: past 24 tokens
    images = [png_b64((255, 0, 0)), truncated, png_b64((0, 0, 255))]
    splits = ("nobackfill_encoder_splits_total", {"encoder": "clip-isolation", "cause": "raised"})
    before = metrics.REGISTRY.get_sample_value(*splits) or 0.0
    await batcher.start()
    try:
        text_calls = [batcher.submit([text], "text") for text in texts]
        image_calls = [batcher.submit([image], "image") for image in images]
        text_rows = await asyncio.gather(*text_calls)
        image_rows = await asyncio.gather(*image_calls, return_exceptions=True)
    finally:
        await batcher.stop()
    # One batch of texts, one of images, then the three images re-run one by one after that batch raised.
    batches = metrics.REGISTRY.get_sample_value("nobackfill_encoder_batch_size_count", {"encoder": "clip-isolation"})
    assert batches == 5
    for text, rows in zip(texts, text_rows, strict=True):  # as alone: the padding beside the long one is masked
        np.testing.assert_allclose(rows, encoder.encode([text], "text"), atol=1e-5)
    assert isinstance(image_rows[1], InputError) and image_rows[1].code == "invalid_input"
    for i in (0, 2):
        np.testing.assert_allclose(image_rows[i], encoder.encode([images[i]], "image"), atol=1e-5)  # type: ignore[arg-type]
    assert metrics.REGISTRY.get_sample_value(*splits) == before + 1


def test_each_encoder_runs_with_its_own_thread_count(tmp_path: Path) -> None:
    folder = tiny_static(tmp_path / "s")
    seen: dict[str, int] = {}

    def run(name: str, threads: int) -> None:
        encoder = create_encoder(
            EncoderSettings(backend="sentence-transformers", path=str(folder), threads=threads), "old"
        )
        encoder.encode(["some words"])
        seen[name] = torch.get_num_threads()  # what this worker thread runs with after a batch

    workers = [threading.Thread(target=run, args=(name, n)) for name, n in (("a", 1), ("b", 2))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert seen == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "absent", "does not exist"),
        (lambda root: root, "no weight files"),
    ],
)
def test_missing_folder_or_weights_is_one_clear_line(tmp_path: Path, make: Any, message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match=message) as caught:
        create_encoder(EncoderSettings(backend="sentence-transformers", path=str(make(tmp_path))), "old")
    assert "\n" not in caught.value.message


def test_unloadable_weights_name_the_folder(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match=f"cannot load the model in {tmp_path}") as caught:
        create_encoder(EncoderSettings(backend="clip", path=str(tmp_path)), "new")
    assert "\n" not in caught.value.message


def test_backend_without_path_says_what_it_needs() -> None:
    with pytest.raises(InputError, match="needs a local model folder"):
        create_encoder(EncoderSettings(backend="sentence-transformers"), "new")


def test_missing_model_library_names_the_extra() -> None:
    # A None entry in sys.modules makes the import fail exactly as an uninstalled package does.
    script = (
        "import sys; sys.modules['sentence_transformers'] = None\n"
        "from service.encoders.registry import create_encoder\n"
        "from service.settings import EncoderSettings\n"
        "from service.errors import InputError\n"
        f"settings = EncoderSettings(backend='sentence-transformers', path={str(packaged_minilm())!r})\n"
        "try: create_encoder(settings, 'old')\n"
        "except InputError as exc: print(exc.message)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert "nobackfill[models]" in done.stdout and "sentence_transformers" in done.stdout


# -- plug-ins through the entry-point group ------------------------------------------------------

PLUGIN_CODE = '''\
"""A user's own encoder package: the synthetic new model under another backend name."""

from service.encoders.synthetic import synthetic_encoder


class ToyEncoder:
    def __init__(self, device):
        self.inner = synthetic_encoder("new", device)
        self.dim, self.model_id, self.device = self.inner.dim, self.inner.model_id, device

    def encode(self, batch, modality="text"):
        return self.inner.encode(batch, modality)

    def warmup(self):
        self.inner.warmup()

    def details(self):
        return {"backend": "toy-plugin"}


def create(settings, device):
    return ToyEncoder(device)
'''


def toy_plugin_wheel(root: Path) -> Path:
    """A wheel of a one-module distribution that declares backend `toy` in the nobackfill.encoders group."""
    wheel = root / "nobackfill_toy-0.1-py3-none-any.whl"
    info = "nobackfill_toy-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("nobackfill_toy.py", PLUGIN_CODE)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: nobackfill-toy\nVersion: 0.1\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/entry_points.txt", f"[{ENTRY_POINT_GROUP}]\ntoy = nobackfill_toy:create\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy plug-in installed by pip into a temporary folder (not into the venv)."""
    root = tmp_path_factory.mktemp("plugin")
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(toy_plugin_wheel(root)),
        ],
        check=True,
        timeout=120,
    )
    return site


def test_plugin_backend_is_found_through_the_entry_point(plugin_site: Path) -> None:
    script = (
        "from service.encoders.registry import backends, create_encoder\n"
        "from service.encoders.base import describe\n"
        "from service.settings import EncoderSettings\n"
        "enc = create_encoder(EncoderSettings(backend='toy', device='cpu'), 'new')\n"
        "print('toy' in backends(), describe(enc)['backend'], enc.encode(['item-0000000001 caption-1']).shape)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), os.getcwd()])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "toy-plugin", "(1,", "768)"]
    assert "toy" not in backends()  # not installed into this interpreter: only the temporary folder has it


def test_service_serves_a_plugin_backend(plugin_site: Path, world: World) -> None:
    env = {
        "PYTHONPATH": os.pathsep.join([str(plugin_site), os.getcwd()]),
        "NOBACKFILL_NEW__BACKEND": "toy",
    }
    with serve_process(world, env=env) as base:
        info = httpx.get(f"{base}/v1/info", timeout=10).json()
        answer = httpx.post(f"{base}/v1/search", json={"queries": [{"text": "item-0000000042 caption-1"}]}, timeout=30)
    assert info["new_model"]["backend"] == "toy-plugin" and info["new_model"]["dim"] == 768
    assert answer.status_code == 200 and 42 in answer.json()["results"][0]["ids"]
