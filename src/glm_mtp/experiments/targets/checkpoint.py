"""Finding and loading the shipped checkpoint (or any directory the training wrote)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glm_mtp.reference.weights import MtpWeights

from ..training.bpe import BpeTokenizer
from .target import TargetWeights

SHIPPED = "glm5-mtp-stdlib"
# The glm5_next family's shipped small model (training=next_stdlib; model=next_shipped).
SHIPPED_NEXT = "glm5next-mtp-stdlib"
SHIPPED_NAMES = (SHIPPED, SHIPPED_NEXT)


def shipped_checkpoint(name: str = SHIPPED) -> Path:
    """A checkpoint shipped with the package (``name``: ``SHIPPED``, the GLM-5 one, or
    ``SHIPPED_NEXT``): ``glm_mtp.checkpoints`` package data when installed, else ``checkpoints/``
    beside the package folders (a source tree or editable install)."""
    if name not in SHIPPED_NAMES:
        raise ValueError(f"model.shipped must be one of {SHIPPED_NAMES}, got {name!r}")
    try:
        from importlib.resources import files

        p = Path(str(files("glm_mtp.checkpoints") / name))
        if (p / "config.json").exists():
            return p
    except ModuleNotFoundError:
        pass
    p = Path(__file__).resolve().parents[2] / "checkpoints" / name
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"the shipped checkpoint is not at {p}; train one with `python -m "
                                f"glm_mtp.experiments.train out={p}`")
    return p


@dataclass
class LoadedModel:
    """A target, its MTP layer (sharing the embedding and head tensors) and, for a trained
    checkpoint, its tokenizer and held-out item names. A checkpoint in the release layout
    (``load_hf_checkpoint``) has no ``target`` weights: ``hf`` holds transformers' model of it
    (``hf_target.HfCheckpoint``), and the drafter reads its own copy of the embedding and head."""

    target: TargetWeights | None
    mtp: MtpWeights
    tokenizer: Any
    heldout: list[str]
    path: str | None
    hf: Any = None


def load_checkpoint(path: str | os.PathLike[str] | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a checkpoint directory (default: the shipped one) in ``dtype``."""
    path = Path(path) if path else shipped_checkpoint()
    target = TargetWeights.from_pretrained(path, dtype=dtype)
    mtp = MtpWeights.from_pretrained(path, dtype=dtype)
    mtp.embed_tokens, mtp.lm_head = target.embed_tokens, target.lm_head  # one copy, as engines read them
    tok = BpeTokenizer.load(path / "tokenizer.json") if (path / "tokenizer.json").exists() else None
    heldout = []
    if (path / "corpus.json").exists():
        with open(path / "corpus.json") as f:
            heldout = json.load(f)["heldout"]
    return LoadedModel(target, mtp, tok, heldout, str(path))


def load_hf_checkpoint(path: str | os.PathLike[str], device: str, dtype: torch.dtype) -> LoadedModel:
    """A checkpoint in the release layout: transformers' target (``hf_target.load_hf_model``) on
    ``device``, the drafter (``MtpWeights.from_pretrained``) beside the target's head, the
    checkpoint's tokenizer (None without one) and, as the held-out text, the shipped corpus's. A
    checkpoint this package trained (``corpus.json`` beside it) keeps its own BPE tokenizer and
    held-out split."""
    from .hf_target import drafter_device, load_hf_model

    path = os.fspath(path)
    ours = os.path.exists(os.path.join(path, "corpus.json"))
    hf = load_hf_model(path, device, dtype, tokenizer=not ours)
    mtp = MtpWeights.from_pretrained(path, dtype=dtype, device=drafter_device(hf))
    with open(os.path.join(path, "corpus.json") if ours else shipped_checkpoint() / "corpus.json") as f:
        heldout = json.load(f)["heldout"]
    tokenizer = BpeTokenizer.load(Path(path) / "tokenizer.json") if ours else hf.tokenizer
    return LoadedModel(None, mtp, tokenizer, heldout, path, hf)


def random_model(preset: str, seed: int, dtype: torch.dtype) -> LoadedModel:
    """A random target and MTP layer of an ``MtpConfig`` preset, sharing embedding and head."""
    from glm_mtp.reference.config import MtpConfig

    cfg = MtpConfig.preset(preset)
    target = TargetWeights.random(cfg, seed=seed, dtype=dtype)
    mtp = MtpWeights.random(cfg, seed=seed + 1, dtype=dtype)
    mtp.embed_tokens, mtp.lm_head = target.embed_tokens, target.lm_head
    return LoadedModel(target, mtp, None, [], None)
