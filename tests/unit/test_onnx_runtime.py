"""Runtime `onnx`: a tiny random BERT sentence-transformer exported, served, and refused when it is not its model's.

The model is tiny and random (2 layers, 32-d, the packaged MiniLM's WordPiece tokenizer, truncation at
24 tokens), so export and load take seconds; its rows mean nothing, but the graph, the tokenizer, the
passes, the pooling and the identity are the real code's.  The same checks on the real MiniLM, over
a thousand texts and in a child process, are in tests/integration/test_onnx_minilm.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from service.encoders.base import Encoder, describe  # noqa: E402
from service.encoders.onnx_export import export_model  # noqa: E402
from service.encoders.onnx_record import MODEL_NAME, RECORD_NAME, read_export  # noqa: E402
from service.encoders.registry import create_encoder, identity_of  # noqa: E402
from service.errors import ArtifactError, InputError, SettingsError  # noqa: E402
from service.settings import EncoderSettings, Settings  # noqa: E402
from tests.support.cli import cli  # noqa: E402
from tests.support.tiny_models import TOKENIZER_FILES, packaged_minilm  # noqa: E402

BACKEND = "sentence-transformers"
DIM = 32
MAX_TOKENS = 24


def tiny_bert_sentence_transformer(folder: Path, seed: int) -> Path:
    """A random 2-layer BERT under mean pooling and Normalize, saved as a SentenceTransformer folder."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel

    try:  # sentence-transformers 6 moved the modules; 5.x has only the old path
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    torch.manual_seed(seed)
    source = packaged_minilm()
    vocab = sum(1 for _ in (source / "vocab.txt").open(encoding="utf-8"))
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    bert = folder.parent / f"{folder.name}-bert"
    BertModel(config).eval().save_pretrained(bert)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, bert / name)
    modules = [Transformer(str(bert), max_seq_length=MAX_TOKENS), Pooling(DIM, pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    shutil.rmtree(bert)
    return folder


def varied_texts(n: int, seed: int = 0) -> list[str]:
    """n texts of 0 to ~60 words from the MiniLM README's vocabulary: short, padded, and past the truncation."""
    rng = random.Random(seed)
    words = (packaged_minilm() / "README.md").read_text(encoding="utf-8").split()
    return ["", "a", *(" ".join(rng.choices(words, k=rng.randint(1, 60))) for _ in range(n - 2))]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model, its fp32 and int8 exports, and a second tiny model (other weights)."""
    root = tmp_path_factory.mktemp("onnx")
    model = tiny_bert_sentence_transformer(root / "tiny-bert", seed=0)
    other = tiny_bert_sentence_transformer(root / "other-bert", seed=1)
    export_model(model, root / "fp32")
    export_model(model, root / "int8", int8=True)
    return {"model": model, "other": other, "fp32": root / "fp32", "int8": root / "int8"}


def encoder(model: Path, onnx_dir: Path | None = None, **extra: object) -> Encoder:
    """The service's encoder: torch without onnx_dir, runtime onnx with it."""
    runtime = {"runtime": "onnx", "onnx_dir": str(onnx_dir)} if onnx_dir else {}
    settings = EncoderSettings.model_validate(
        {"backend": BACKEND, "path": str(model), "device": "cpu", "threads": 1, **runtime, **extra}
    )
    return create_encoder(settings, "new")


def test_fp32_rows_match_torch_within_1e_4_cosine(models: dict[str, Path]) -> None:
    texts = varied_texts(300)
    torch_rows = encoder(models["model"]).encode(texts)
    onnx_rows = encoder(models["model"], models["fp32"]).encode(texts)
    assert onnx_rows.dtype == np.float32 and onnx_rows.shape == (300, DIM)
    cosines = (torch_rows * onnx_rows).sum(axis=1)
    assert cosines.min() >= 1 - 1e-4, cosines.min()
    np.testing.assert_allclose(np.linalg.norm(onnx_rows, axis=1), 1.0, atol=1e-5)


def test_rows_do_not_depend_on_the_batch_or_its_passes(models: dict[str, Path]) -> None:
    # Length-sorted passes of 4 (the default), one pass, and one text at a time give the same rows.
    texts = varied_texts(40, seed=3)
    in_passes = encoder(models["model"], models["fp32"]).encode(texts)
    one_pass = encoder(models["model"], models["fp32"], cpu_forward_batch_size=0).encode(texts)
    alone = np.concatenate([encoder(models["model"], models["fp32"]).encode([text]) for text in texts[:8]])
    np.testing.assert_allclose(in_passes, one_pass, atol=1e-5)
    np.testing.assert_allclose(in_passes[:8], alone, atol=1e-5)


def test_int8_loads_and_gives_unit_rows_close_to_fp32(models: dict[str, Path]) -> None:
    texts = varied_texts(200, seed=1)
    fp32 = encoder(models["model"], models["fp32"]).encode(texts)
    int8 = encoder(models["model"], models["int8"]).encode(texts)
    np.testing.assert_allclose(np.linalg.norm(int8, axis=1), 1.0, atol=1e-5)
    cosines = (fp32 * int8).sum(axis=1)
    assert cosines.mean() > 0.99 and cosines.min() > 0.95, (cosines.mean(), cosines.min())
    assert not np.allclose(fp32, int8, atol=1e-4)  # it is quantised: the rows moved
    assert (models["int8"] / MODEL_NAME).stat().st_size < (models["fp32"] / MODEL_NAME).stat().st_size


def test_the_export_records_its_source_and_its_agreement_with_torch(models: dict[str, Path]) -> None:
    fp32, int8 = read_export(models["fp32"]), read_export(models["int8"])
    torch_identity = identity_of(encoder(models["model"]), BACKEND)
    assert fp32.source == int8.source == torch_identity
    assert (fp32.precision, int8.precision) == ("fp32", "int8")
    assert fp32.max_seq_length == MAX_TOKENS and fp32.inputs[:2] == ("input_ids", "attention_mask")
    assert fp32.check["min_cosine"] >= 1 - 1e-4
    assert 0.9 < int8.check["min_cosine"] <= int8.check["mean_cosine"] < 1


def test_the_onnx_encoder_keeps_the_torch_identity_and_says_its_runtime(models: dict[str, Path]) -> None:
    onnx = encoder(models["model"], models["int8"])
    assert identity_of(onnx, BACKEND) == identity_of(encoder(models["model"]), BACKEND)
    info = describe(onnx)
    assert (info["runtime"], info["precision"], info["threads"], info["modalities"]) == ("onnx", "int8", 1, ["text"])
    with pytest.raises(InputError, match="encodes text only"):
        onnx.encode(["x.png"], "image")
    assert onnx.encode([]).shape == (0, DIM)


def test_an_export_of_another_model_is_refused_in_one_line(models: dict[str, Path]) -> None:
    with pytest.raises(ArtifactError, match="was made from another model") as refused:
        encoder(models["other"], models["fp32"])
    assert "\n" not in refused.value.message and str(models["other"]) in refused.value.message


def test_a_missing_or_edited_export_is_refused_in_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        encoder(models["model"], tmp_path / "nowhere")
    edited = tmp_path / "edited"
    shutil.copytree(models["fp32"], edited)
    record = json.loads((edited / RECORD_NAME).read_text())
    (edited / RECORD_NAME).write_text(json.dumps({**record, "max_seq_length": 512}))
    with pytest.raises(ArtifactError, match=r"onnx.json: .*manifest.json"):
        encoder(models["model"], edited)
    (edited / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        encoder(models["model"], edited)
    with pytest.raises(ArtifactError, match="no onnx.json"):
        encoder(models["model"], models["model"])  # a model folder is not an export


def test_runtime_onnx_runs_on_the_cpu_only(models: dict[str, Path]) -> None:
    with pytest.raises(InputError, match="runs on the CPU"):
        encoder(models["model"], models["fp32"], device="cuda:0")


def test_the_export_refuses_to_write_into_the_model_or_over_a_folder(models: dict[str, Path], tmp_path: Path) -> None:
    # model.onnx is a weight file: inside the model folder it would change the model's own fingerprint.
    with pytest.raises(InputError, match="inside the model folder"):
        export_model(models["model"], models["model"] / "onnx")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="--force"):
        export_model(models["model"], tmp_path / "taken")
    with pytest.raises(InputError, match="does not exist"):
        export_model(tmp_path / "no-model", tmp_path / "out")


def test_settings_refuse_runtime_onnx_without_its_folder_or_for_another_backend() -> None:
    with pytest.raises(SettingsError, match="NOBACKFILL_NEW__RUNTIME=onnx needs NOBACKFILL_NEW__ONNX_DIR"):
        Settings(new=EncoderSettings(backend=BACKEND, path="m", runtime="onnx"))
    with pytest.raises(SettingsError, match="runs NOBACKFILL_OLD__BACKEND=sentence-transformers models only"):
        Settings(old=EncoderSettings(backend="clip", path="m", runtime="onnx", onnx_dir="o"))
    assert Settings(new=EncoderSettings(backend=BACKEND, path="m", runtime="onnx", onnx_dir="o")).new.runtime == "onnx"


def test_the_cli_exports_with_extra_check_texts_and_says_how_close_it_is(
    models: dict[str, Path], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from service.cli import app

    extra = tmp_path / "texts.txt"
    extra.write_text("first extra text\n\nsecond extra text\n", encoding="utf-8")
    out = tmp_path / "cli-int8"
    args = ["encoder", "export", str(models["model"]), "--out", str(out), "--int8", "--check-texts", str(extra)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    export = read_export(out)
    assert export.precision == "int8" and export.check["texts"] == 13 + 2  # the built-in texts and the two lines
    assert f"wrote {out}" in done.output and "as int8 ONNX" in done.output and "over 15 check texts" in done.output


def test_encode_takes_the_export_with_onnx_and_gives_the_torch_rows_and_identity(
    models: dict[str, Path], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from service.cli import app

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(t or "x" for t in varied_texts(40, seed=3)) + "\n", encoding="utf-8")
    common = ["encode", "--backend", BACKEND, "--path", str(models["model"]), "--input", str(texts), "--threads", "1"]
    torch_done = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "torch.npy")])
    onnx_done = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "onnx.npy"), "--onnx", str(models["fp32"])])
    assert torch_done.exit_code == onnx_done.exit_code == 0, onnx_done.output
    torch_rows, onnx_rows = np.load(tmp_path / "torch.npy"), np.load(tmp_path / "onnx.npy")
    assert onnx_rows.shape == (40, DIM) and (torch_rows * onnx_rows).sum(axis=1).min() >= 1 - 1e-4
    # The same model identity either way: what a profile and a segment check.
    torch_meta, onnx_meta = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("torch", "onnx"))
    identity = ("backend", "model_id", "fingerprint", "dim")
    assert [torch_meta[key] for key in identity] == [onnx_meta[key] for key in identity]
    refused = cli("encode", "--backend", "synthetic-new", "--input", texts, "--out", tmp_path / "s.npy", "--onnx",
                  models["fp32"])  # fmt: skip
    assert refused.returncode == 2 and "--onnx runs sentence-transformers models only" in refused.stderr


def test_the_onnx_line_demo_real_prints_exports_a_model_the_printed_settings_serve(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import shlex

    from typer.testing import CliRunner

    from service.cli import app
    from service.commands.real_demo import RealDeployment

    real = RealDeployment(tmp_path / "real")
    shutil.copytree(models["model"], real.new_model)  # the tiny model where demo --real keeps MiniLM
    hint = real.onnx_hint()
    command = shlex.split(hint.split("`")[1])[1:]  # the pasted command, without the program's own path
    done = CliRunner().invoke(app, command)
    assert done.exit_code == 0, done.output
    variables = dict(word.split("=", 1) for word in hint.split() if word.startswith("NOBACKFILL_NEW__"))
    assert variables["NOBACKFILL_NEW__RUNTIME"] == "onnx"
    served = EncoderSettings.model_validate(
        {"backend": BACKEND, "path": str(real.new_model), "threads": 1, "runtime": "onnx",
         "onnx_dir": variables["NOBACKFILL_NEW__ONNX_DIR"]}
    )  # fmt: skip
    torch_settings = EncoderSettings.model_validate({"backend": BACKEND, "path": str(real.new_model), "threads": 1})
    onnx_encoder, torch_encoder = create_encoder(served, "new"), create_encoder(torch_settings, "new")
    assert identity_of(onnx_encoder, BACKEND) == identity_of(torch_encoder, BACKEND)
    assert read_export(Path(variables["NOBACKFILL_NEW__ONNX_DIR"])).precision == "int8"
