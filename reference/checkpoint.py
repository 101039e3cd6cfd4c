"""Reading and writing GLM-5 style checkpoints: ``config.json`` plus safetensors, one file or
sharded with ``model.safetensors.index.json``. Only the tensors asked for are read."""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .config import MtpConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not hold what its config promises."""


def checkpoint_weight_map(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> file name, from the index or from the single file's header."""
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(single):
        with safe_open(single, "pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise CheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")


def read_tensors(directory: str | os.PathLike[str], names: list[str], weight_map: dict[str, str]) -> dict[str, Tensor]:
    """Read exactly ``names``, opening each shard once; other tensors' bytes are never touched."""
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(weight_map[n], []).append(n)
    out: dict[str, Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(os.path.join(os.fspath(directory), file), "pt") as f:
            for n in wanted:
                out[n] = f.get_tensor(n)
    return out


def check_shape(name: str, tensor: Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def load_mtp_tensors(
    directory: str | os.PathLike[str], cfg: MtpConfig, experts: range | None = None
) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """The MTP layer's tensors (layer-relative names), the embedding and the head; of the routed
    experts only those in ``experts`` when given (an expert-parallel rank's block) are read.

    Raises ``CheckpointError`` naming the tensor for a missing tensor, an unexpected tensor
    inside the MTP layer, or a wrong shape.
    """
    from .weights import IGNORED_MTP_COPIES, mtp_tensor_shapes

    wmap = checkpoint_weight_map(directory)
    prefix = f"model.layers.{cfg.mtp_layer_index}."
    expected = mtp_tensor_shapes(cfg)
    present = {k[len(prefix):] for k in wmap if k.startswith(prefix)}
    for name, shape in expected.items():
        if name not in present:
            raise CheckpointError(f"missing tensor {prefix + name!r} (expected shape {shape})")
    extra = sorted(present - expected.keys() - set(IGNORED_MTP_COPIES))
    if extra:
        raise CheckpointError(f"unexpected tensor {prefix + extra[0]!r} in the MTP layer ({len(extra)} unexpected in all)")
    outer = ["model.embed_tokens.weight", "lm_head.weight"]
    config_path = os.path.join(os.fspath(directory), "config.json")
    tied = False
    if "lm_head.weight" not in wmap:
        with open(config_path) as f:
            tied = bool(json.load(f).get("tie_word_embeddings", False))
        if not tied:
            raise CheckpointError(f"missing tensor 'lm_head.weight' (expected shape {(cfg.vocab_size, cfg.hidden_size)})")
        outer.remove("lm_head.weight")
    if "model.embed_tokens.weight" not in wmap:
        raise CheckpointError(f"missing tensor 'model.embed_tokens.weight' (expected shape {(cfg.vocab_size, cfg.hidden_size)})")
    if experts is not None:
        skipped = {f"mlp.experts.{e}." for e in range(cfg.n_routed_experts) if e not in experts}
        expected = {n: s for n, s in expected.items() if not any(n.startswith(p) for p in skipped)}
    tensors = read_tensors(directory, [prefix + n for n in expected] + outer, wmap)
    mtp = {n: tensors[prefix + n] for n in expected}
    for name, shape in expected.items():
        check_shape(prefix + name, mtp[name], shape)
    embed = tensors["model.embed_tokens.weight"]
    head = embed if tied else tensors["lm_head.weight"]
    check_shape("model.embed_tokens.weight", embed, (cfg.vocab_size, cfg.hidden_size))
    check_shape("lm_head.weight", head, (cfg.vocab_size, cfg.hidden_size))
    return mtp, embed, head


def save_checkpoint(
    directory: str | os.PathLike[str], config: dict[str, Any], tensors: dict[str, Tensor], shard_size: int | None = None
) -> None:
    """Write ``config.json`` and the tensors; with ``shard_size``, at most that many tensors per
    file plus ``model.safetensors.index.json``, as the hub's sharded checkpoints are laid out."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    flat = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if shard_size is None:
        save_file(flat, os.path.join(directory, SINGLE_FILE), metadata={"format": "pt"})
        return
    names = sorted(flat)
    chunks = [names[i : i + shard_size] for i in range(0, len(names), shard_size)]
    weight_map: dict[str, str] = {}
    total = 0
    for i, chunk in enumerate(chunks):
        file = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: flat[k] for k in chunk}, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in chunk})
        total += sum(flat[k].numel() * flat[k].element_size() for k in chunk)
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)

