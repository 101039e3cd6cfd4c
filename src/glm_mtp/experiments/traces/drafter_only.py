"""A checkpoint cut to what a replay needs (DESIGN.md §11): the MTP layer's tensors, the
embedding and the head, with the checkpoint's ``config.json`` (unchanged, so the trace's target
config still matches), its tokenizer files and corpus split. No target layer is copied: a replay
from it proves that none is read.
"""

from __future__ import annotations

import json
import os
import shutil

from glm_mtp.reference.checkpoint import checkpoint_weight_map, read_tensors, save_checkpoint
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import embed_head_tensor_shapes

# Files beside the weights that a drafter-only directory keeps (tokenizer, chat template, split).
COMPANIONS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "corpus.json", "generation_config.json")


def drafter_tensor_names(directory: str, cfg: MtpConfig) -> list[str]:
    """Every tensor of the checkpoint under the MTP layer's prefix (weights, fp8 scales, the
    routing bias), then the embedding and the head."""
    names = [n for n in checkpoint_weight_map(directory) if n.startswith(cfg.layer_prefix)]
    return names + list(embed_head_tensor_shapes(cfg))


def write_drafter_only(src: str, out: str) -> list[str]:
    """Write the drafter-only copy of checkpoint ``src`` into ``out`` (replaced as a whole, as
    ``save_checkpoint`` does). Returns the tensor names written."""
    cfg = MtpConfig.from_hf_config(src)
    names = drafter_tensor_names(src, cfg)
    tensors = read_tensors(src, names, checkpoint_weight_map(src))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    save_checkpoint(out, config, tensors)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(out, "config.json"))  # byte for byte
    for name in COMPANIONS:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    return names
