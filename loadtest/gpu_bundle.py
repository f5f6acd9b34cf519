"""Pack the real upgrade's new model and corpus small enough to travel to a GPU host, and unpack them there.

    python loadtest/gpu_bundle.py pack --real artifacts/real --out .whl/bundle
    python loadtest/gpu_bundle.py unpack --bundle .whl/bundle --out artifacts/real-gpu

What travels (.whl/bundle/):
    minilm-fp16.planes.xz   all-MiniLM-L6-v2's model.safetensors with every float tensor cast to float16
                            (what the service runs on CUDA anyway: `fp16` casts the fp32 weights with
                            the same rounding), its bytes split into two planes (every even byte, then
                            every odd one: a float16's high byte, sign and exponent, compresses well
                            apart from its noisy low byte) and xz-compressed
    files.tar.xz            the model folder's other files (tokenizer, configs, pooling) and the corpus
                            files `demo --real` reads (corpus.json, support / test pairs, gallery texts, ids)
    manifest.json           sizes and sha256 of the float16 weights, checked after unpacking
Unpacking is lossless (stdlib lzma and tarfile, numpy) and lays out REAL/models/all-MiniLM-L6-v2 and
REAL/corpus; the old static model is distilled there from this float16 MiniLM (gpu_check.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import tarfile
from pathlib import Path

import numpy as np

MODEL = "all-MiniLM-L6-v2"
WEIGHTS = "model.safetensors"
PLANES = "minilm-fp16.planes.xz"
FILES = "files.tar.xz"
MANIFEST = "manifest.json"
# The model folder's files besides the weights that SentenceTransformer reads.
MODEL_FILES = (
    "config.json",
    "config_sentence_transformers.json",
    "modules.json",
    "sentence_bert_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "1_Pooling/config.json",
)
# What `demo --real`'s prepare() reads from the corpus folder.
CORPUS_FILES = ("corpus.json", "support.jsonl", "test.jsonl", "gallery.txt", "gallery_ids.npy")


def fp16_weights(source: Path) -> bytes:
    """The safetensors bytes of `source` with every floating tensor cast to float16 (others as they are)."""
    from safetensors.torch import load_file, save

    tensors = load_file(str(source))
    return save({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, metadata={"format": "pt"})


def to_planes(data: bytes) -> bytes:
    """Even bytes, then odd bytes (a trailing odd byte stays last)."""
    a = np.frombuffer(data, dtype=np.uint8)
    even = a[: a.size - a.size % 2]
    return np.ascontiguousarray(even.reshape(-1, 2).T).tobytes() + a[even.size :].tobytes()


def from_planes(data: bytes, size: int) -> bytes:
    """Inverse of to_planes for the original `size` bytes."""
    a = np.frombuffer(data, dtype=np.uint8)
    pairs = size - size % 2
    return np.ascontiguousarray(a[:pairs].reshape(2, -1).T).tobytes() + a[pairs:size].tobytes()


def pack(real: Path, out: Path) -> None:
    """Write the bundle for `real` (a `demo --real` folder) into `out`."""
    model, corpus = real / "models" / MODEL, real / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    weights = fp16_weights(model / WEIGHTS)
    (out / PLANES).write_bytes(lzma.compress(to_planes(weights), preset=9 | lzma.PRESET_EXTREME))
    with tarfile.open(out / FILES, "w:xz", preset=9) as tar:
        for name in MODEL_FILES:
            tar.add(model / name, arcname=f"models/{MODEL}/{name}")
        for name in CORPUS_FILES:
            tar.add(corpus / name, arcname=f"corpus/{name}")
    manifest = {"weights_bytes": len(weights), "weights_sha256": hashlib.sha256(weights).hexdigest()}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(json.dumps({"bundle": str(out), "bytes": sizes, "total": sum(sizes.values())}, indent=2))


def unpack(bundle: Path, out: Path) -> None:
    """Lay out out/models/all-MiniLM-L6-v2 (float16) and out/corpus from the bundle; verify the weights."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    weights = from_planes(lzma.decompress((bundle / PLANES).read_bytes()), manifest["weights_bytes"])
    if hashlib.sha256(weights).hexdigest() != manifest["weights_sha256"]:
        raise SystemExit(f"{bundle / PLANES}: the unpacked weights do not match {MANIFEST}")
    with tarfile.open(bundle / FILES, "r:xz") as tar:
        tar.extractall(out, filter="data")
    target = out / "models" / MODEL / WEIGHTS
    target.write_bytes(weights)
    print(f"unpacked {target} ({len(weights):,} bytes, float16) and {out / 'corpus'}")


def main() -> None:
    """pack | unpack."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--real", type=Path, default=Path("artifacts/real"))
    p.add_argument("--out", type=Path, default=Path(".whl/bundle"))
    u = sub.add_parser("unpack")
    u.add_argument("--bundle", type=Path, default=Path(".whl/bundle"))
    u.add_argument("--out", type=Path, default=Path("artifacts/real-gpu"))
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.real, args.out)
    else:
        unpack(args.bundle, args.out)


if __name__ == "__main__":
    main()
