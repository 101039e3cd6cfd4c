"""What ties a trace to a drafter: the target's configuration and the tokenizer (DESIGN.md §11).

A replay may run another checkpoint's MTP layer of the same target (a retrained head, a
quantized one, a drafter-only directory): its ``config.json`` then describes the same target.
``target_config_sha256`` hashes that description without the drafter's own settings, so those
checkpoints match and another target's config does not; the tokenizer is compared by the sha256
of its file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from glm_mtp.reference.config import MtpConfig

# config.json keys that describe the MTP layer's behaviour, not the target's (dropped at any depth).
DRAFTER_ONLY_KEYS = ("index_share_for_mtp_iteration",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _without_drafter_keys(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _without_drafter_keys(v) for k, v in x.items() if k not in DRAFTER_ONLY_KEYS}
    if isinstance(x, list):
        return [_without_drafter_keys(v) for v in x]
    return x


def target_config_sha256(directory: str) -> str:
    """sha256 of the checkpoint's ``config.json`` as canonical JSON (sorted keys, no spaces),
    ``DRAFTER_ONLY_KEYS`` removed."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    text = json.dumps(_without_drafter_keys(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def random_target_sha256(preset: str, seed: int) -> str:
    """The identity of a random model (``model=tiny_random``): its preset's fields and the seed."""
    cfg = dataclasses.asdict(MtpConfig.preset(preset))
    text = json.dumps(_without_drafter_keys({"preset": cfg, "seed": seed}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_sha256(directory: str | None) -> str | None:
    """sha256 of the directory's tokenizer file (the first of ``TOKENIZER_FILES`` present); None
    without a directory or a tokenizer."""
    from ..targets.provenance import file_sha256

    if directory is None:
        return None
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return file_sha256(path)
    return None


def model_identity(mcfg: Any, path: str | None) -> dict[str, Any]:
    """``{"target_config_sha256", "tokenizer_sha256"}`` of the ``model`` group's checkpoint
    (``path``: its directory; None for ``kind: random``)."""
    if path is None:
        return {"target_config_sha256": random_target_sha256(mcfg.preset, int(mcfg.seed)), "tokenizer_sha256": None}
    return {"target_config_sha256": target_config_sha256(path), "tokenizer_sha256": tokenizer_sha256(path)}


def check_drafter(meta: dict[str, Any], cfg: MtpConfig, identity: dict[str, Any]) -> None:
    """The trace's metadata against the drafter that will replay it: hidden size, vocabulary,
    tokenizer, the target's config. ``ValueError`` naming the trace's field on a mismatch."""
    if meta["hidden_size"] != cfg.hidden_size:
        raise ValueError(f"hidden_size: the trace holds hiddens of {meta['hidden_size']}, the drafter reads "
                         f"{cfg.hidden_size}")
    if meta["vocab_size"] != cfg.vocab_size:
        raise ValueError(f"vocab_size: the trace's target has {meta['vocab_size']} tokens, the drafter "
                         f"{cfg.vocab_size}")
    if meta.get("tokenizer_sha256") != identity["tokenizer_sha256"]:
        raise ValueError(f"tokenizer_sha256: the trace was recorded with tokenizer {meta.get('tokenizer_sha256')}, "
                         f"the drafter's checkpoint has {identity['tokenizer_sha256']} (another tokenizer)")
    recorded = meta["target"].get("target_config_sha256")
    if recorded != identity["target_config_sha256"]:
        raise ValueError(f"target.target_config_sha256: the trace's target is {recorded}, the drafter's checkpoint "
                         f"describes {identity['target_config_sha256']} (another target's config)")
