"""`nobackfill encode` and `nobackfill support build`: inputs, bad inputs, atomic outputs, identities downstream.

The library functions (service.bulk) are called directly for the fine-grained cases; the commands run
in-process through service.cli.main (same parsing, error line and exit code, no Python + torch start
per call) and, for the end-to-end paths a user walks, as `python -m service.cli` subprocesses.  With real
weights (the packaged all-MiniLM-L6-v2, a tiny random static model): tests/system/test_encode_real_models.py.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from service.bulk.encode import check_rows, encode_file, sidecar_identity
from service.bulk.inputs import Bad, Blank, Item, input_spec, read_items, scan
from service.bulk.pairs import read_pairs
from service.bulk.support import EncodeOptions, ModelSource, build_support, check_support_out
from service.compat.io import load_split
from service.encoders.base import Modality
from service.encoders.identity import ModelIdentity
from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder, format_item
from service.errors import ArtifactError, InputError, NobackfillError
from tests.support.cli import Done, cli, run_cli, write_pairs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SYNTH_OLD = ModelIdentity("synthetic-old", "synthetic-old", None, 512)


def error_line(done: Done) -> str:
    """The `error: ...` line of a failed run (exit 2), checked to be its last line."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), done.stderr
    return last


def files_in(folder: Path) -> list[str]:
    """Every name in `folder`, hidden ones included, sorted."""
    return sorted(p.name for p in folder.iterdir())


def captions(n: int, first: int = 0) -> list[str]:
    """Synthetic-world text inputs: caption 1 of items first..first+n-1."""
    return [format_item(i, 1) for i in range(first, first + n)]


def png(path: Path, colour: tuple[int, int, int]) -> Path:
    """A small real PNG file."""
    Image.new("RGB", (12, 9), colour).save(path, format="PNG")
    return path


# --------------------------------------------------------------------------- reading inputs


def test_text_lines_are_read_as_written_and_bad_lines_named(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(b"\xef\xbb\xbf  first  \r\nsecond\n\n   \nbad \xff\xfe bytes\nlast without newline")
    items = list(read_items(input_spec(src, "text", None, None), check_images=False))
    assert items == [
        Item(1, "  first  "),  # BOM and CR-LF gone, the text itself untouched
        Item(2, "second"),
        Blank(3),  # blank lines hold no input: skipped and counted, never an error
        Blank(4),
        Bad(5, f"{src}:5", "not valid UTF-8"),
        Item(6, "last without newline"),
    ]
    with pytest.raises(InputError, match=rf"^{src}:5: not valid UTF-8 \(use --skip-bad"):
        scan(input_spec(src, "text", None, None), skip_bad=False)
    checked = scan(input_spec(src, "text", None, None), skip_bad=True)
    assert checked.count == 3 and [b.line for b in checked.skipped] == [5] and checked.blank == 2


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"text": "fine", "id": 7}', None),
        ('{"text": "no id"}', "id field 'id' is missing or not a 64-bit integer"),
        ('{"text": "bool id", "id": true}', "id field 'id' is missing"),
        ('{"text": "huge id", "id": 9223372036854775808}', "not a 64-bit integer"),
        ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        ('["a list"]', "expected a JSON object, got list"),
        ('{"title": "x", "id": 1}', "no field 'text'"),
        ('{"text": 42, "id": 1}', "field 'text' is not a non-empty string (got 42)"),
        ('{"text": "  ", "id": 1}', "field 'text' is not a non-empty string"),
    ],
)
def test_jsonl_rows(tmp_path: Path, line: str, reason: str | None) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(line + "\n", encoding="utf-8")
    (item,) = read_items(input_spec(src, "text", "text", "id"), check_images=False)
    if reason is None:
        assert item == Item(1, "fine", 7)
    else:
        assert isinstance(item, Bad) and item.where == f"{src}:1" and reason in item.reason, item


def test_input_kinds_and_refused_combinations(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"t": "x"}\n')
    (tmp_path / "a.txt").write_text("x\n")
    assert input_spec(tmp_path / "a.txt", "text", None, None).kind == "lines"
    assert input_spec(tmp_path / "a.txt", "text", "t", None).kind == "jsonl"  # --field means JSONL
    assert input_spec(tmp_path, "image", None, None).kind == "folder"
    for args, message in [
        ((tmp_path / "a.jsonl", "text", None, None), "a JSONL file needs --field KEY"),
        ((tmp_path, "text", None, None), "a folder of image files needs --modality image"),
        ((tmp_path, "image", "t", None), "--field / --id-field apply to a JSONL file"),
        ((tmp_path / "a.txt", "text", None, "id"), "--id-field applies to a JSONL file"),
        ((tmp_path / "missing.txt", "text", None, None), "no such file or folder"),
    ]:
        with pytest.raises(InputError, match=message):
            input_spec(*args)  # type: ignore[arg-type]


def test_images_are_checked_before_any_model_runs(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    png(folder / "b.png", (0, 0, 255))
    png(folder / "a.PNG", (255, 0, 0))
    (folder / "c.jpg").write_bytes(b"this is not a jpeg")
    (folder / "notes.txt").write_text("not an image, not an input")
    png(folder / ".hidden.png", (1, 2, 3))
    checked = scan(input_spec(folder, "image", None, None), skip_bad=True)
    assert checked.count == 2
    assert [(b.where, b.reason) for b in checked.skipped] == [
        (str(folder / "c.jpg"), "not an image file (PIL cannot identify it)")
    ]
    # A list of paths: relative ones are resolved against the list's folder.
    listing = tmp_path / "list.txt"
    listing.write_text("images/a.PNG\nimages/missing.png\n")
    with pytest.raises(InputError) as err:
        scan(input_spec(listing, "image", None, None), skip_bad=False)
    assert err.value.message.startswith(f"{listing}:2: image {folder / 'missing.png'}: cannot read (No such file")
    # Through the CLI, the bad image is refused before the (unloadable) model folder is even looked at.
    model = ("--backend", "clip", "--path", tmp_path / "no-model", "--modality", "image")
    done = cli("encode", *model, "--input", listing, "--out", tmp_path / "out" / "e.npy")
    assert f"{listing}:2: image" in error_line(done)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- what an encoder returns


def test_check_rows_refuses_what_a_model_should_never_return() -> None:
    good = np.full((2, 4), 0.5, dtype=np.float64)
    rows = check_rows(good, 2, 4, "x")
    assert rows.dtype == np.float32 and np.array_equal(rows, good)
    nan = good.copy()
    nan[1, 0] = np.nan
    for bad, message in [
        (good[:1], r"returned \(1, 4\), expected \(2, 4\)"),
        (good[:, :3], r"returned \(2, 3\), expected \(2, 4\)"),
        ([[1.0] * 4] * 2, "returned list"),
        (nan, "returned NaN or inf in 1 row"),
        (np.zeros((2, 4)), "returned 2 all-zero row"),
    ]:
        with pytest.raises(NobackfillError, match=f"^where: the encoder {message}"):
            check_rows(bad, 2, 4, "where")


class Faulty:
    """The synthetic old model, misbehaving on the `at`-th call: wrong shape, NaN rows, an exception or Ctrl-C."""

    def __init__(self, fault: str, at: int = 2) -> None:
        self.inner = SyntheticOldEncoder()
        self.dim, self.model_id, self.device = self.inner.dim, self.inner.model_id, "cpu"
        self.fault, self.at, self.calls = fault, at, 0

    def encode(self, batch: list[str], modality: Modality = "text") -> npt.NDArray[np.float32]:
        self.calls += 1
        rows = self.inner.encode(batch, modality)
        if self.calls < self.at:
            return rows
        if self.fault == "shape":
            return rows[:-1]
        if self.fault == "nan":
            rows[0, 0] = np.nan
            return rows
        if self.fault == "interrupt":
            raise KeyboardInterrupt
        if self.fault == "input":
            raise InputError("image 2 of the batch cannot be decoded")
        raise RuntimeError("CUDA out of memory\nmore lines")

    def warmup(self) -> None:
        pass


@pytest.mark.parametrize(
    ("fault", "error", "message"),
    [
        ("shape", NobackfillError, r"in.txt:5-8: the encoder returned \(3, 512\), expected \(4, 512\)"),
        ("nan", NobackfillError, r"in.txt:5-8: the encoder returned NaN or inf in 1 row"),
        ("raise", NobackfillError, r"in.txt:5-8: the encoder failed \(RuntimeError: CUDA out of memory\)$"),
        ("input", InputError, r"^.*in.txt:5-8: image 2 of the batch cannot be decoded$"),
        ("interrupt", KeyboardInterrupt, None),
    ],
)
def test_a_failure_midway_leaves_the_previous_output_untouched(
    tmp_path: Path, fault: str, error: type[BaseException], message: str | None
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(captions(10)) + "\n")
    out = tmp_path / "out" / "e.npy"
    out.parent.mkdir()
    out.write_bytes(b"previous embeddings")
    out.with_suffix(".json").write_text("{}")
    spec = input_spec(src, "text", None, None)
    checked = scan(spec, skip_bad=False)
    with pytest.raises(error, match=message):
        encode_file(Faulty(fault), SYNTH_OLD, spec, checked, out, batch_size=4, progress=False)
    assert files_in(out.parent) == ["e.json", "e.npy"]  # no hidden temporaries left
    assert out.read_bytes() == b"previous embeddings" and out.with_suffix(".json").read_text() == "{}"
    # Folders made for the output go too.
    fresh, ids = tmp_path / "new" / "deep" / "e.npy", tmp_path / "new" / "ids.npy"
    with pytest.raises(error, match=message):
        encode_file(Faulty(fault), SYNTH_OLD, spec, checked, fresh, ids_out=ids, batch_size=4, progress=False)
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- encode_file


def test_encode_jsonl_with_ids_skips_bad_rows_and_describes_itself(tmp_path: Path) -> None:
    texts = captions(9)
    rows = [json.dumps({"text": t, "id": 1000 + i}) for i, t in enumerate(texts)]
    rows[3] = json.dumps({"text": "", "id": 3})  # line 4
    rows[6] = "{broken"  # line 7
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    spec = input_spec(src, "text", "text", "id")
    checked = scan(spec, skip_bad=True)
    out, ids = tmp_path / "e.npy", tmp_path / "ids.npy"
    meta = encode_file(SyntheticOldEncoder(), SYNTH_OLD, spec, checked, out, ids_out=ids, batch_size=2, progress=False)

    kept = [i for i in range(9) if i not in (3, 6)]
    expected = SyntheticOldEncoder().encode([texts[i] for i in kept])
    np.testing.assert_array_equal(np.load(out), expected)  # exactly what the service's encoder gives
    np.testing.assert_array_equal(np.load(ids), [1000 + i for i in kept])
    assert json.loads(out.with_suffix(".json").read_text()) == meta
    assert meta["backend"] == "synthetic-old" and meta["model_id"] == "synthetic-old" and meta["fingerprint"] is None
    assert (meta["dim"], meta["count"], meta["modality"], meta["dtype"]) == (512, 7, "text", "float32")
    assert meta["input"] == str(src.resolve()) and meta["field"] == "text" and meta["skipped"] == 2
    assert [(s["line"], s["reason"][:12]) for s in meta["skipped_inputs"]] == [(4, "field 'text'"), (7, "not valid JS")]
    assert files_in(tmp_path) == ["e.json", "e.npy", "ids.npy", "in.jsonl"]
    assert sidecar_identity(out, 7, 512) == SYNTH_OLD
    with pytest.raises(ArtifactError, match="describes 7 rows of dim 512, but e.npy holds 8"):
        sidecar_identity(out, 8, 512)


def test_image_inputs_reach_the_encoder_as_base64_file_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    files = [png(folder / f"{name}.png", colour) for name, colour in (("x", (9, 9, 9)), ("a", (200, 10, 10)))]
    spec = input_spec(folder, "image", None, None)
    out = tmp_path / "e.npy"
    encode_file(SyntheticOldEncoder(), SYNTH_OLD, spec, scan(spec, skip_bad=False), out, progress=False)
    sent = [base64.b64encode(f.read_bytes()).decode() for f in sorted(files)]  # sorted by name: a.png, x.png
    np.testing.assert_array_equal(np.load(out), SyntheticOldEncoder().encode(sent, "image"))


# --------------------------------------------------------------------------- the encode command


@pytest.mark.parametrize(
    ("content", "line", "reason"),
    [
        (b"item-1\n\xc3\x28 bad utf-8\nitem-2\nitem-3", 2, "not valid UTF-8"),
        (b"item-1\nitem-2\n{bad\xff\nitem-3\n", 3, "not valid UTF-8"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path: Path, content: bytes, line: int, reason: str
) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(content)
    out = tmp_path / "out" / "e.npy"
    done = cli("encode", "--backend", "synthetic-old", "--input", src, "--out", out, "--device", "cpu")
    assert error_line(done) == f"error: {src}:{line}: {reason} (use --skip-bad to skip bad inputs)"
    assert not out.parent.exists()
    done = cli("encode", "--backend", "synthetic-old", "--input", src, "--out", out, "--device", "cpu", "--skip-bad")
    assert done.returncode == 0, done.stderr
    assert f"skipping 1 bad input(s), first: {src}:{line}: {reason}" in done.stderr
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["count"] == 3 and meta["skipped"] == 1 and meta["skipped_inputs"][0]["line"] == line
    assert np.load(out).shape == (3, 512)


def test_cli_refuses_existing_outputs_and_bad_options(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(captions(3)) + "\n")
    out = tmp_path / "e.npy"
    base = ("encode", "--backend", "synthetic-new", "--input", src, "--device", "cpu")
    assert cli(*base, "--out", out).returncode == 0
    before = out.read_bytes()
    assert error_line(cli(*base, "--out", out)) == f"error: {out}: exists (use --force to replace it)"
    out.unlink()  # a lone OUT.json is protected too
    assert "e.json: exists" in error_line(cli(*base, "--out", out))
    assert cli(*base, "--out", out, "--force").returncode == 0 and out.read_bytes() == before
    assert "--out must name a .npy file" in error_line(cli(*base, "--out", tmp_path / "e.bin"))
    assert "give --ids-out IDS.npy too" in error_line(cli(*base, "--out", tmp_path / "f.npy", "--id-field", "id"))
    assert "takes no path" in error_line(cli(*base, "--out", tmp_path / "f.npy", "--path", tmp_path))
    assert "unknown encoder backend 'nope'" in error_line(
        cli("encode", "--backend", "nope", "--input", src, "--out", tmp_path / "f.npy")
    )
    assert not (tmp_path / "f.npy").exists() and files_in(tmp_path) == ["e.json", "e.npy", "in.txt"]


def test_encode_then_gallery_build_records_the_model_identity(tmp_path: Path) -> None:
    """As a user would: text file -> `nobackfill encode` -> `gallery build --from-npy` (subprocesses)."""
    src = tmp_path / "gallery.txt"
    src.write_text("\n".join(format_item(i) for i in range(600)) + "\n")
    emb = tmp_path / "emb" / "old.npy"
    run_cli("encode", "--backend", "synthetic-old", "--input", src, "--out", emb, "--device", "cpu")
    small = ("--nlist", 4, "--pq-m", 8, "--nbits", 4)
    run_cli("gallery", "build", "--from-npy", emb, "--out", tmp_path / "g", *small)
    meta = json.loads((tmp_path / "g" / "gallery.json").read_text())
    assert meta["old_model_id"] == "synthetic-old" and meta["old_model"] == SYNTH_OLD.as_dict()
    # --model-id overrides the id (and only the id); without OUT.json and --model-id the model is unknown.
    assert (
        cli("gallery", "build", "--from-npy", emb, "--out", tmp_path / "g2", *small, "--model-id", "renamed").returncode
        == 0
    )
    meta = json.loads((tmp_path / "g2" / "gallery.json").read_text())
    assert meta["old_model_id"] == "renamed" and meta["old_model"]["backend"] == "synthetic-old"
    bare = tmp_path / "bare.npy"
    shutil.copy(emb, bare)
    assert cli("gallery", "build", "--from-npy", bare, "--out", tmp_path / "g3", *small).returncode == 0
    meta = json.loads((tmp_path / "g3" / "gallery.json").read_text())
    assert meta["old_model_id"] == "unknown" and meta["old_model"] is None


# --------------------------------------------------------------------------- pairs and support build


def test_pairs_ids_dedup_and_bad_rows(tmp_path: Path) -> None:
    q, t = captions(4), [format_item(i) for i in range(4)]
    shared = write_pairs(
        tmp_path / "p.jsonl",
        [
            {"query": q[0], "target": t[0], "target_id": 10},
            {"query": q[1], "target": t[0], "target_id": 10},  # a second query of the same target
            {"query": q[2], "target": t[2], "query_id": 12},  # query_id alone names the target
            {"query": q[3], "target": t[3], "query_id": 13, "target_id": 13},
            {"query": q[3], "target": t[1], "target_id": 10},  # target 10 is something else: bad
            {"query": q[3], "target": t[3], "query_id": 1, "target_id": 2},
            "",
            {"query": q[3]},
            "",
        ],
    )
    pairs = read_pairs(shared, "text", "text", skip_bad=True)
    assert pairs.blank == 2  # blank lines (the last one too) are no pairs and no errors
    assert pairs.query_ids == [10, 10, 12, 13] and pairs.query_lines == [1, 2, 3, 4]
    assert pairs.targets == [t[0], t[2], t[3]] and pairs.target_ids == [10, 12, 13]
    assert [(b.line, b.reason) for b in pairs.skipped] == [
        (5, "target_id 10 is given another target on line 1"),
        (6, "query_id 1 != target_id 2 (a query's id is the id of the target it should retrieve)"),
        (8, "'target' is missing or not a non-empty string (got None)"),
    ]
    with pytest.raises(InputError, match=rf"^{shared}:5: target_id 10 is given another target on line 1 \(use"):
        read_pairs(shared, "text", "text", skip_bad=False)
    plain_rows: list[dict[str, Any] | str] = [{"query": a, "target": b} for a, b in zip(q, t, strict=True)]
    plain = read_pairs(write_pairs(tmp_path / "plain.jsonl", plain_rows), "text", "text", skip_bad=False)
    assert plain.query_ids == plain.target_ids == [0, 1, 2, 3] and plain.targets == t
    mixed_rows: list[dict[str, Any] | str] = [
        {"query": q[0], "target": t[0]},
        {"query": q[1], "target": t[1], "target_id": 5},
    ]
    mixed = write_pairs(tmp_path / "mixed.jsonl", mixed_rows)
    with pytest.raises(InputError, match=r"mixed.jsonl:2: an id, unlike the rows before it \(ids: all or none\)"):
        read_pairs(mixed, "text", "text", skip_bad=True)
    images = write_pairs(tmp_path / "img.jsonl", [{"query": q[0], "target": "missing.png"}])
    with pytest.raises(InputError, match=rf"img.jsonl:1: target image {tmp_path / 'missing.png'}: cannot read"):
        read_pairs(images, "text", "image", skip_bad=False)


def test_build_support_with_the_synthetic_models_loads_as_a_split(tmp_path: Path) -> None:
    items = list(range(40))
    rows: list[dict[str, Any] | str] = [
        {"query": format_item(i, c), "target": format_item(i), "target_id": i} for i in items for c in (0, 1)
    ]
    # Synthetic models take item strings, so both sides are "text" here (the strings name the view).
    pairs = read_pairs(write_pairs(tmp_path / "p.jsonl", rows), "text", "text", skip_bad=False)
    out = tmp_path / "support"
    models = build_support(
        pairs,
        ModelSource("synthetic-old", None),
        ModelSource("synthetic-new", None),
        out,
        query_modality="text",
        target_modality="text",
        options=EncodeOptions(device="cpu", batch_size=16, progress=False),
    )
    assert files_in(tmp_path) == ["p.jsonl", "support"]
    split = load_split(out, require_new_target=True)
    old, new = SyntheticOldEncoder(), SyntheticNewEncoder()
    np.testing.assert_array_equal(split.old_query, old.encode([r["query"] for r in rows], "text"))  # type: ignore[index]
    np.testing.assert_array_equal(split.new_target, new.encode([format_item(i) for i in items]))
    np.testing.assert_array_equal(split.query_ids, np.repeat(items, 2))
    np.testing.assert_array_equal(split.target_ids, items)
    assert json.loads((out / "models.json").read_text()) == models
    assert models["old"] == SYNTH_OLD.as_dict() and models["new"]["dim"] == 768
    assert (models["pairs"], models["targets"], models["query_modality"], models["target_modality"]) == (
        80,
        40,
        "text",
        "text",
    )
    # A second build into the same folder: refused, then replaced with --force (support folders only).
    with pytest.raises(InputError, match=r"already holds a support folder \(use --force to replace it\)"):
        check_support_out(out, force=False)
    check_support_out(out, force=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="is not a support folder; refusing to overwrite it"):
        check_support_out(tmp_path / "other", force=True)


def test_support_build_then_fit_takes_the_model_ids(tmp_path: Path) -> None:
    """As a user would: pairs -> `support build` (subprocess) -> `fit`, which records models.json's identities."""
    rows: list[dict[str, Any] | str] = [
        {"query": format_item(i, c), "target": format_item(i), "target_id": i} for i in range(200) for c in (0, 1)
    ]
    rows.insert(5, "not json")
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    support = tmp_path / "support"
    common = ("--old-backend", "synthetic-old", "--new-backend", "synthetic-new", "--device", "cpu")
    done = run_cli("support", "build", "--pairs", pairs, "--out", support, *common, check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(f"error: {pairs}:6: not valid JSON")
    assert files_in(tmp_path) == ["pairs.jsonl"]
    done = run_cli(
        "support", "build", "--pairs", pairs, "--out", support, *common, "--skip-bad", "--target-modality", "text"
    )
    assert "400 queries, 200 targets, 1 skipped" in done.stdout
    models = json.loads((support / "models.json").read_text())
    assert models["skipped_inputs"] == [{"line": 6, "reason": models["skipped_inputs"][0]["reason"]}]

    fit = cli("fit", support, "--out", tmp_path / "profile", "--folds", 3)
    assert fit.returncode == 0 and "warning" not in fit.stderr, fit.stderr
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert (profile["old_model_id"], profile["new_model_id"]) == ("synthetic-old", "synthetic-new")
    assert profile["models"] == {"old": models["old"], "new": models["new"]}
    # Without models.json fit refuses to guess: both ids must be given; given ids override models.json's.
    bare = tmp_path / "bare"
    shutil.copytree(support, bare)
    (bare / "models.json").unlink()
    refused = error_line(cli("fit", bare, "--out", tmp_path / "p2", "--folds", 3, "--old-model-id", "mine"))
    assert f"{bare / 'models.json'}: missing; pass --new-model-id" in refused
    assert not (tmp_path / "p2").exists()
    fit = cli("fit", bare, "--out", tmp_path / "p2", "--folds", 3, "--old-model-id", "mine", "--new-model-id", "v2")
    assert fit.returncode == 0, fit.stderr
    profile = json.loads((tmp_path / "p2" / "profile.json").read_text())
    assert (profile["old_model_id"], profile["new_model_id"]) == ("mine", "v2") and "models" not in profile
    fit = cli("fit", support, "--out", tmp_path / "p3", "--folds", 3, "--new-model-id", "v2")
    profile = json.loads((tmp_path / "p3" / "profile.json").read_text())
    assert profile["new_model_id"] == profile["models"]["new"]["model_id"] == "v2"
    models["old"]["dim"] = 256
    (support / "models.json").write_text(json.dumps(models))
    assert "the old model is 256-d, but old_query.npy holds 512-d rows" in error_line(
        cli("fit", support, "--out", tmp_path / "p4")
    )


def test_synth_support_writes_models_json(tmp_path: Path) -> None:
    assert cli("synth", "support", "--n", 20, "--out", tmp_path / "s").returncode == 0
    models = json.loads((tmp_path / "s" / "models.json").read_text())
    assert models["old"] == SYNTH_OLD.as_dict()
    assert models["new"] == {"backend": "synthetic-new", "model_id": "synthetic-new", "fingerprint": None, "dim": 768}
    assert (models["query_modality"], models["target_modality"], models["pairs"]) == ("text", "image", 20)


def test_blank_lines_are_skipped_counted_and_the_rows_count_the_other_lines(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(b"item-0000000001 image\n\n  \nitem-0000000002 image\n\n")
    out = tmp_path / "e.npy"
    done = cli("encode", "--backend", "synthetic-old", "--input", src, "--out", out, "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "3 blank line(s) ignored" in done.stdout
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["count"] == 2 and meta["blank_lines"] == 3 and meta["skipped"] == 0
    rows = np.load(out)
    from service.encoders.synthetic import SyntheticOldEncoder

    expected = SyntheticOldEncoder().encode(["item-0000000001 image", "item-0000000002 image"], "text")
    assert np.allclose(rows, expected, atol=1e-6)  # row i is the i-th non-blank line
