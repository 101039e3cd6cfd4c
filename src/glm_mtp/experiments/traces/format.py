"""The trace file format (DESIGN.md §11, §14; every field in docs/traces.md), version 2.

A trace is a directory:

    trace.json              the metadata record (``FORMAT``, ``VERSION``, the target, the tokenizer,
                            the prompts, the generation, the costs, one entry per item)
    items-00000.safetensors one shard: its items' arrays, concatenated along positions
    items-00001.safetensors ...

Each shard holds ``tokens`` int32 (N,), ``argmax`` int32 (N,), ``hidden`` (N, H) in the dtype the
target produced, in a sampled trace (generation temperature > 0) ``sample`` int32 (N,) and, in a
teacher-forced trace, ``greedy`` int32 (N, K + 1): the N rows of its items
one after another (item i at rows ``[start, start + length)``, from ``trace.json``), so one item
is read by slicing, without the rest of the shard.

A trace is untrusted input: every rule of the format is checked in one module, ``validate``
(``trace.json`` within size, depth and number bounds before it is parsed into objects, every
field by its type and range, each shard's header before its arrays, each item's bytes).
``validate.problems`` lists what is wrong with one, one line per problem naming the file, the
field and the rule, and ``validate.open_trace`` refuses the first of them before any work:
``traces check`` and the replay run the same walk.

Version 2 adds, per item, its prompt identity (``items[i].prompt``: source, index, sha256) and, in a
sampled trace, the ``sample`` array with the sampler's settings in ``generation``. Version 1 is
still read: its items' prompt identity is unknown (``TraceItem.prompt`` None) and it is greedy.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

FORMAT = "glm-mtp-trace"
VERSION = 2  # what this package writes
READ_VERSIONS = (1, 2)  # what it reads (version 1: greedy, no prompt identity)
META = "trace.json"
MODES = ("speculative", "teacher_forced")
HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}
ARRAYS = ("tokens", "argmax", "hidden")  # every shard's; a sampled trace adds "sample", a teacher-forced "greedy"
NOT_RECORDED = -1  # greedy[p, j >= 1] before an item's prompt_len: no chain is recorded there


def shard_name(i: int) -> str:
    """The file name of shard ``i``."""
    return f"items-{i:05d}.safetensors"


@dataclass
class TraceItem:
    """One recorded sequence.

    Args:
        tokens: int32 (L,): the prompt, then the target's greedy continuation (teacher-forced: the text).
        argmax: int32 (L,): the target's greedy next token after each position.
        hidden: (L, H): the target's post-final-norm hidden at each position, in its own dtype.
        prompt_len: P, the prompt's tokens (1 <= P < L).
        greedy: int32 (L, K + 1) for teacher-forced traces: row p holds the target's greedy
            continuation of K + 1 tokens after ``tokens[: p + 1]`` (``greedy[p, 0] == argmax[p]``;
            ``NOT_RECORDED`` in columns >= 1 of rows p < P); None in speculative traces.
        dropped: positions cut at the first near-tie of the two recording passes (0: none).
        sample: int32 (L,) in a sampled trace: the target's seeded sample (§14) after each position
            (``tokens[p + 1] == sample[p]`` on the generated path); None in a greedy trace.
        prompt: the item's prompt identity ``{"source", "index", "sha256"}``
            (``prompt_id.prompt_identity``); None where unknown (a version-1 trace).
    """

    tokens: Tensor
    argmax: Tensor
    hidden: Tensor
    prompt_len: int
    greedy: Tensor | None = None
    dropped: int = 0
    sample: Tensor | None = None
    prompt: dict[str, Any] | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    def arrays(self) -> dict[str, Tensor]:
        out = {"tokens": self.tokens, "argmax": self.argmax, "hidden": self.hidden}
        if self.sample is not None:
            out["sample"] = self.sample
        if self.greedy is not None:
            out["greedy"] = self.greedy
        return out


def item_sha256(item: TraceItem) -> str:
    """sha256 of an item: ``prompt_len`` (8 bytes little-endian), then per array in the order
    tokens, argmax, sample (when present), greedy (when present), hidden: its name, dtype name and
    shape as UTF-8 text ``name:dtype:d0,d1;`` followed by its raw little-endian bytes (bf16 as its
    2-byte patterns). The prompt identity is not hashed here: its sha256 is checked against the
    item's prompt tokens (``check_item``)."""
    h = hashlib.sha256(struct.pack("<q", item.prompt_len))
    order = ["tokens", "argmax", *(["sample"] if item.sample is not None else []),
             *(["greedy"] if item.greedy is not None else []), "hidden"]
    arrays = item.arrays()
    for name in order:
        x = arrays[name].contiguous()
        dtype = str(x.dtype).removeprefix("torch.")
        h.update(f"{name}:{dtype}:{','.join(str(d) for d in x.shape)};".encode())
        h.update(x.view(torch.uint8).numpy().tobytes() if x.numel() else b"")
    return h.hexdigest()


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_trace(directory: str, meta: dict[str, Any], items: list[TraceItem], rows_per_shard: int = 1 << 16) -> str:
    """Write ``items`` and ``meta`` (every field but ``format``, ``version``, ``shards`` and
    ``items``, which this fills) as a trace into ``directory`` (created; it must not hold a
    trace already). Items go into shards of about ``rows_per_shard`` positions (an item is never
    split). Every item carries its prompt identity (``TraceItem.prompt``). Returns the sha256 of
    the written ``trace.json``."""
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(directory, META)):
        raise ValueError(f"trace.out: {directory} already holds a trace ({META}); choose another directory")
    missing = [i for i, it in enumerate(items) if it.prompt is None]
    if missing:
        raise ValueError(f"items[{missing[0]}].prompt: a version-{VERSION} trace names every item's prompt (source, "
                         "index, sha256)")
    os.makedirs(directory, exist_ok=True)
    shards: list[list[TraceItem]] = [[]]
    rows = 0
    for it in items:
        if shards[-1] and rows + it.length > rows_per_shard:
            shards.append([])
            rows = 0
        shards[-1].append(it)
        rows += it.length
    entries, shard_entries = [], []
    for s, group in enumerate(shards):
        start = 0
        for it in group:
            entries.append({"shard": s, "start": start, "length": it.length, "prompt_len": it.prompt_len,
                            "dropped": it.dropped, "sha256": item_sha256(it), "prompt": it.prompt})
            start += it.length
        names = group[0].arrays().keys()
        tensors = {n: torch.cat([it.arrays()[n] for it in group]).contiguous() for n in names}
        save_file(tensors, os.path.join(directory, shard_name(s)))
        shard_entries.append({"file": shard_name(s), "rows": start})
    record = {"format": FORMAT, "version": VERSION, **meta, "shards": shard_entries, "items": entries}
    path = os.path.join(directory, META)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)  # trace.json last: a directory without it is no trace
    return file_sha256(path)


# ------------------------------------------------------------------------------------------------
# Reading and checking


class TraceError(ValueError):
    """A trace that breaks a rule of the format: ``file`` names the file (``trace.json``, a
    shard's), ``field`` where in it (``items[3].hidden``); the message is one line
    ``file: field: rule``."""

    def __init__(self, field: str, message: str, file: str | None = None) -> None:
        super().__init__(f"{file}: {field}: {message}" if file else f"{field}: {message}")
        self.field, self.file = field, file


SAMPLER_KEYS = ("temperature", "top_p", "top_k", "seed", "sampler")  # generation's fields a replay must match


def is_sampled(meta: dict[str, Any]) -> bool:
    """Whether the trace was recorded with the seeded sampler (generation temperature > 0)."""
    return meta["generation"]["temperature"] > 0


@dataclass
class Trace:
    """A checked trace: its directory, metadata, the sha256 of its ``trace.json`` and the items
    (held in memory; a shard's rows are sliced, not copied)."""

    path: str
    meta: dict[str, Any]
    sha256: str
    items: list[TraceItem] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return self.meta["mode"]

    @property
    def max_drafts(self) -> int:
        return self.meta["max_drafts"]

    def record(self) -> dict[str, Any]:
        """What a run records of the trace it replayed (summary.json, W&B)."""
        m = self.meta
        return {"path": os.path.abspath(self.path), "sha256": self.sha256, "version": m["version"], "mode": m["mode"],
                "items": len(self.items), "max_drafts": m["max_drafts"], "target": m["target"],
                "tokenizer_sha256": m.get("tokenizer_sha256"), "hidden_dtype": m["hidden_dtype"],
                "truncation": m.get("truncation"), "forwards": m.get("forwards"), "prompts": m.get("prompts"),
                "generation": m.get("generation")}
