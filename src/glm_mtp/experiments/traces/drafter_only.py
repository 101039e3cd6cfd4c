"""A checkpoint cut to what a replay needs (DESIGN.md §11): the MTP layer's tensors, the
embedding and the head, with the checkpoint's ``config.json`` (unchanged, so the trace's target
config still matches), its tokenizer files and corpus split. No target layer is copied: a replay
from it proves that none is read.

Both paths are input (``check_drafter_only``, before anything is read or written): ``src`` an
existing checkpoint whose drafter tensors read, ``out`` a new path or an empty folder in a
writable folder, never ``src`` itself, inside it, or a folder that holds anything (a checkpoint
included: a drafter-only copy over a full checkpoint destroys the target's weights).
"""

from __future__ import annotations

import json
import os
import shutil

from glm_mtp.reference.checkpoint import (check_checkpoint_directory, checkpoint_weight_map, read_tensors,
                                          save_checkpoint)
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import embed_head_tensor_shapes
from torch import Tensor

# Files beside the weights that a drafter-only directory keeps (tokenizer, chat template, split).
COMPANIONS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "corpus.json", "generation_config.json")


def drafter_tensor_names(directory: str, cfg: MtpConfig) -> list[str]:
    """Every tensor of the checkpoint under the MTP layer's prefix (weights, fp8 scales, the
    routing bias), then the embedding and the head."""
    names = [n for n in checkpoint_weight_map(directory) if n.startswith(cfg.layer_prefix)]
    return names + list(embed_head_tensor_shapes(cfg))


def inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both resolved, links followed)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_out_path(out: object, src: str) -> str:
    """``out`` as a drafter-only copy of ``src`` may take it: a text path, new or an empty folder,
    neither ``src`` nor inside it, in a writable folder. ``ValueError`` naming ``out``."""
    from ..settings.validate import unwritable_dir

    if not isinstance(out, str) or not out:
        raise ValueError(f"out must be a directory path, got {out!r}")
    if inside(out, src):
        raise ValueError(f"out: {out} is the source checkpoint {src} or inside it (the copy would overwrite the "
                         "target's weights): choose a new folder outside it")
    if os.path.islink(out) and not os.path.exists(out):
        raise ValueError(f"out: {out} is a broken symbolic link")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ValueError(f"out: {out} exists and is not a folder")
        if os.listdir(out):
            raise ValueError(f"out: {out} is not empty (a drafter-only copy goes into a new or empty folder; nothing "
                             "is overwritten)")
    why = unwritable_dir(os.path.dirname(os.path.abspath(out)))
    if why is not None:
        raise ValueError(f"out must be in a writable folder: {why}")
    return out


def check_drafter_only(src: object, out: object) -> tuple[MtpConfig, dict[str, Tensor]]:
    """Both arguments checked and the drafter's tensors read, before anything is written:
    ``src`` an existing checkpoint folder (its ``config.json`` a drafter's, its MTP layer,
    embedding and head readable), ``out`` as ``check_out_path``. Returns the config and the
    tensors; ``ValueError`` naming ``src`` or ``out`` otherwise."""
    src = check_checkpoint_directory("src", src)
    if not os.access(src, os.R_OK | os.X_OK):
        raise ValueError(f"src: {src} is not readable")
    check_out_path(out, src)
    try:
        cfg = MtpConfig.from_hf_config(src)
        names = drafter_tensor_names(src, cfg)
        tensors = read_tensors(src, names, checkpoint_weight_map(src))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"src: {src} is not a readable checkpoint ({e})"[:400]) from None
    return cfg, tensors


def write_drafter_only(src: str, out: str) -> list[str]:
    """Write the drafter-only copy of checkpoint ``src`` into ``out`` (a new or empty folder;
    ``check_drafter_only`` refuses anything else before any write). Returns the tensor names
    written."""
    _, tensors = check_drafter_only(src, out)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    save_checkpoint(out, config, tensors)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(out, "config.json"))  # byte for byte
    for name in COMPANIONS:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    return list(tensors)
