"""The fine-tuned head's checkpoint (DESIGN.md §13 "Output"): the layout it was read from.

Every drafter tensor of the input (``traces.drafter_only.drafter_tensor_names``: the MTP layer's
tensors under its prefix, fp8 scales and routing bias included, then the embedding and the head)
is written into a file of the same name as the one the input holds it in, with the same name,
shape and dtype; an input with ``model.safetensors.index.json`` gets one restricted to these
tensors. No target layer is written. A trained tensor is its fp32 master copy cast to the input's
dtype (round to nearest even), or, for an fp8 block-scaled weight, requantized by DESIGN §8's
quantizer (``fp8.quantize_fp8``) into its ``W8`` and ``*_scale_inv``; every other tensor (the
embedding, the head, the routing bias, an MTP layer's stored embedding copy) is the input's own
bytes. ``config.json`` and the companions (tokenizer, corpus split) are copied byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import Tensor

from glm_mtp.reference import fp8
from glm_mtp.reference.checkpoint import INDEX_FILE, checkpoint_weight_map, read_tensors
from glm_mtp.reference.config import MtpConfig

from ..traces.drafter_only import COMPANIONS, drafter_tensor_names


def input_tensors(directory: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The drafter's tensors of the checkpoint at ``directory`` as stored (name -> tensor) and the
    file each is in."""
    cfg = MtpConfig.from_hf_config(directory)
    wmap = checkpoint_weight_map(directory)
    names = drafter_tensor_names(directory, cfg)
    return read_tensors(directory, names, wmap), {n: wmap[n] for n in names}


def tuned_tensors(stored: dict[str, Tensor], trained: dict[str, Tensor]) -> dict[str, Tensor]:
    """The output's tensors: ``stored`` (the input's, by checkpoint name) with each name in
    ``trained`` (fp32 masters by checkpoint name) replaced, cast or requantized (module docstring)."""
    out = dict(stored)
    for name, master in trained.items():
        old = stored[name]
        if old.dtype == fp8.FP8_DTYPE:
            q = fp8.quantize_fp8(master.detach(), name)
            out[name], out[fp8.scale_name(name)] = q.w8, q.scale_inv
        else:
            out[name] = master.detach().to(old.dtype).contiguous()
        assert out[name].shape == old.shape, name
    return out


def write_checkpoint(src: str, out: str, tensors: dict[str, Tensor], files: dict[str, str]) -> None:
    """Write ``tensors`` into ``out`` (an existing, empty directory), each into ``files[name]``
    (the input's file names), the index when ``src`` has one, and ``src``'s ``config.json`` and
    companions byte for byte."""
    from safetensors.torch import save_file

    by_file: dict[str, dict[str, Tensor]] = {}
    for name in sorted(tensors):
        by_file.setdefault(files[name], {})[name] = tensors[name].contiguous()
    for file, group in sorted(by_file.items()):
        save_file(group, os.path.join(out, file), metadata={"format": "pt"})
    if os.path.exists(os.path.join(src, INDEX_FILE)):
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": {n: files[n] for n in sorted(tensors)}}, f,
                      indent=2)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(out, "config.json"))
    for name in COMPANIONS:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))


def master_copies(stored: dict[str, Tensor], prefix: str, trainable: tuple[str, ...]) -> dict[str, Tensor]:
    """fp32 master copies (leaves requiring grad) of the MTP layer's trainable tensors, by
    checkpoint name: every floating tensor under ``prefix`` whose layer-relative name is not the
    routing bias nor an fp8 scale nor a stored embedding/head copy, fp8 weights dequantized
    (``up(W8) * s``). ``trainable``: layer-relative names allowed (empty: all of those)."""
    from glm_mtp.reference.checkpoint import IGNORED_MTP_COPIES
    from glm_mtp.reference.weights import ROUTING_BIAS

    out = {}
    for name, t in stored.items():
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        if (rel.endswith(ROUTING_BIAS) or rel.endswith(fp8.SCALE_SUFFIX) or rel in IGNORED_MTP_COPIES
                or (trainable and rel not in trainable)):
            continue
        if t.dtype == fp8.FP8_DTYPE:
            w = fp8.dequantize(fp8.BlockScaledWeight(t, stored[fp8.scale_name(name)]), torch.float32)
        else:
            w = t.to(torch.float32)
        out[name] = w.clone().requires_grad_(True)
    return out
