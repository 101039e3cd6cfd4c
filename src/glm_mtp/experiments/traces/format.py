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

A trace is untrusted input: ``problems`` lists what is wrong with one, field by field (the
validator's report), and ``open_trace`` refuses the first problem naming its field, before any
work. Nothing here trusts a length, a dtype or a digest it has not checked. Every rule of the
format is checked here, in this one module.

Version 2 adds, per item, its prompt identity (``items[i].prompt``: source, index, sha256) and, in a
sampled trace, the ``sample`` array with the sampler's settings in ``generation``. Version 1 is
still read: its items' prompt identity is unknown (``TraceItem.prompt`` None) and it is greedy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator, TypeGuard

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
    """A trace that breaks a rule of the format: ``field`` names where (``items[3].hidden``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _int(x: Any, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def read_meta(directory: str) -> dict[str, Any]:
    """``trace.json`` of ``directory``, parsed and its top-level fields checked (``TraceError``)."""
    path = os.path.join(directory, META)
    if not os.path.isdir(directory):
        raise TraceError("trace.path", f"{directory} is not a directory")
    if not os.path.isfile(path):
        raise TraceError(META, f"{path} is missing (not a trace directory)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(META, f"not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise TraceError(META, "must hold a JSON object")
    for name, rule, ok in (
        ("format", f"must be {FORMAT!r}", meta.get("format") == FORMAT),
        ("version", f"must be one of {READ_VERSIONS} (the versions this package reads)",
         meta.get("version") in READ_VERSIONS and not isinstance(meta.get("version"), bool)),
        ("mode", f"must be one of {MODES}", meta.get("mode") in MODES),
        ("vocab_size", "must be an integer >= 1", _int(meta.get("vocab_size"), 1)),
        ("hidden_size", "must be an integer >= 1", _int(meta.get("hidden_size"), 1)),
        ("hidden_dtype", f"must be one of {tuple(HIDDEN_DTYPES)}", meta.get("hidden_dtype") in HIDDEN_DTYPES),
        ("max_drafts", "must be an integer >= 1", _int(meta.get("max_drafts"), 1)),
        ("target", "must be an object", isinstance(meta.get("target"), dict)),
        ("tokenizer_sha256", "must be a sha256 hex string or null",
         meta.get("tokenizer_sha256") is None or _hex(meta.get("tokenizer_sha256"))),
        ("shards", "must be a non-empty list", isinstance(meta.get("shards"), list) and bool(meta.get("shards"))),
        ("items", "must be a non-empty list", isinstance(meta.get("items"), list) and bool(meta.get("items"))),
    ):
        if not ok:
            raise TraceError(name, f"{rule}, got {meta.get(name)!r}"[:300])
    check_generation(meta)
    costs = meta.get("costs")
    if costs is not None and not valid_costs(costs, meta["max_drafts"]):
        raise TraceError("costs", "must be null or an object with target_step_ms (> 0) and verify_ms (one number > 0 "
                         "per k = 1..max_drafts)")
    for s, sh in enumerate(meta["shards"]):
        if not (isinstance(sh, dict) and sh.get("file") == shard_name(s) and _int(sh.get("rows"), 1)):
            raise TraceError(f"shards[{s}]", f"must be {{'file': {shard_name(s)!r}, 'rows': >= 1}}, got {sh!r}"[:300])
    ends = [0] * len(meta["shards"])
    for i, it in enumerate(meta["items"]):
        where = f"items[{i}]"
        if not isinstance(it, dict):
            raise TraceError(where, "must be an object")
        for name, lo in (("shard", 0), ("start", 0), ("length", 2), ("prompt_len", 1), ("dropped", 0)):
            if not _int(it.get(name), lo):
                raise TraceError(f"{where}.{name}", f"must be an integer >= {lo}, got {it.get(name)!r}")
        if not it["prompt_len"] < it["length"]:
            raise TraceError(f"{where}.prompt_len", f"must be below length={it['length']}, got {it['prompt_len']}")
        if not _hex(it.get("sha256")):
            raise TraceError(f"{where}.sha256", f"must be a sha256 hex string, got {it.get('sha256')!r}")
        if meta["version"] >= 2:
            check_prompt_identity(where, it.get("prompt"))
        s = it["shard"]
        if s >= len(meta["shards"]) or it["start"] != ends[s]:
            raise TraceError(f"{where}.start", f"items must tile their shard in order: expected shard < "
                             f"{len(meta['shards'])} and start {ends[s] if s < len(ends) else '?'}, got shard {s} "
                             f"start {it['start']}")
        ends[s] += it["length"]
    for s, sh in enumerate(meta["shards"]):
        if ends[s] != sh["rows"]:
            raise TraceError(f"shards[{s}].rows", f"is {sh['rows']}, its items hold {ends[s]} rows")
    return meta


SAMPLER_KEYS = ("temperature", "top_p", "top_k", "seed", "sampler")  # generation's fields a replay must match


def is_sampled(meta: dict[str, Any]) -> bool:
    """Whether the trace was recorded with the seeded sampler (generation temperature > 0)."""
    return meta["generation"]["temperature"] > 0


def _number(x: Any) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_generation(meta: dict[str, Any]) -> None:
    """``generation``'s rules. Version 1: ``temperature`` 0. Version 2: ``temperature`` a finite
    number >= 0; at 0 (greedy) ``top_p``, ``top_k``, ``seed`` and ``sampler`` are null; above 0 (a
    sampled trace, speculative mode only) ``top_p`` null or in (0, 1], ``top_k`` null or an
    integer >= 1, ``seed`` an integer and ``sampler`` ``{"name": str, "version": int}``."""
    g = meta.get("generation")
    if not isinstance(g, dict):
        raise TraceError("generation", f"must be an object, got {g!r}"[:300])
    t = g.get("temperature")
    if meta["version"] == 1:
        if t != 0:
            raise TraceError("generation.temperature", f"must be 0 in a version-1 trace (greedy), got {t!r}")
        return
    if not (_number(t) and t >= 0):
        raise TraceError("generation.temperature", f"must be a finite number >= 0, got {t!r}")
    if t == 0:
        for key in SAMPLER_KEYS[1:]:
            if g.get(key) is not None:
                raise TraceError(f"generation.{key}", f"must be null in a greedy trace (temperature 0), got "
                                 f"{g.get(key)!r}")
        return
    if meta["mode"] != "speculative":
        raise TraceError("generation.temperature", f"a sampled trace (temperature > 0) is speculative; mode is "
                         f"{meta['mode']!r}")
    top_p, top_k, seed, sampler = g.get("top_p"), g.get("top_k"), g.get("seed"), g.get("sampler")
    if top_p is not None and not (_number(top_p) and 0 < top_p <= 1):
        raise TraceError("generation.top_p", f"must be null or a number in (0, 1], got {top_p!r}")
    if top_k is not None and not _int(top_k, 1):
        raise TraceError("generation.top_k", f"must be null or an integer >= 1, got {top_k!r}")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and -(1 << 63) <= seed < (1 << 63)):
        raise TraceError("generation.seed", f"must be an integer (int64), got {seed!r}")
    if not (isinstance(sampler, dict) and isinstance(sampler.get("name"), str) and _int(sampler.get("version"), 1)):
        raise TraceError("generation.sampler", f"must be {{'name': str, 'version': int >= 1}}, got {sampler!r}"[:300])


def check_prompt_identity(where: str, prompt: Any) -> None:
    """An item's ``prompt`` (version 2): ``{"source": str, "index": int >= 0, "sha256": hex}``."""
    if not (isinstance(prompt, dict) and isinstance(prompt.get("source"), str) and _int(prompt.get("index"), 0)
            and _hex(prompt.get("sha256"))):
        raise TraceError(f"{where}.prompt", f"must be {{'source': str, 'index': int >= 0, 'sha256': hex}} (the "
                         f"item's prompt identity), got {prompt!r}"[:300])


def _hex(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def valid_costs(costs: Any, max_drafts: int) -> bool:
    """``costs`` holds ``target_step_ms`` > 0 and ``verify_ms`` with one finite number > 0 per k <= max_drafts."""
    def pos(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0

    return (isinstance(costs, dict) and pos(costs.get("target_step_ms")) and isinstance(costs.get("verify_ms"), list)
            and len(costs["verify_ms"]) >= max_drafts and all(pos(x) for x in costs["verify_ms"]))


def read_shard(directory: str, meta: dict[str, Any], s: int) -> dict[str, Tensor]:
    """Shard ``s``'s arrays, their names, dtypes and shapes checked against the metadata."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    name = shard_name(s)
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise TraceError(f"shards[{s}].file", f"{name} is missing")
    try:
        t = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise TraceError(f"shards[{s}].file", f"{name} is not a readable safetensors file ({e})"[:300]) from None
    want = set(ARRAYS) | ({"greedy"} if meta["mode"] == "teacher_forced" else set()) | (
        {"sample"} if is_sampled(meta) else set())
    if set(t) != want:
        raise TraceError(f"shards[{s}]", f"{name} must hold exactly {sorted(want)}, holds {sorted(t)}")
    rows, H, K = meta["shards"][s]["rows"], meta["hidden_size"], meta["max_drafts"]
    shapes = {"tokens": ((rows,), torch.int32), "argmax": ((rows,), torch.int32), "sample": ((rows,), torch.int32),
              "hidden": ((rows, H), HIDDEN_DTYPES[meta["hidden_dtype"]]), "greedy": ((rows, K + 1), torch.int32)}
    for n, x in t.items():
        shape, dtype = shapes[n]
        if x.dtype != dtype:
            raise TraceError(f"shards[{s}].{n}", f"dtype must be {str(dtype).removeprefix('torch.')} (hidden_dtype / "
                             f"the format), got {str(x.dtype).removeprefix('torch.')}")
        if tuple(x.shape) != shape:
            raise TraceError(f"shards[{s}].{n}", f"shape must be {shape} (rows, hidden_size, max_drafts + 1), got "
                             f"{tuple(x.shape)}")
    return t


def item_from_shard(t: dict[str, Tensor], entry: dict[str, Any]) -> TraceItem:
    """Item ``entry`` (its trace.json record) sliced out of its shard's arrays."""
    a, b = entry["start"], entry["start"] + entry["length"]
    return TraceItem(t["tokens"][a:b], t["argmax"][a:b], t["hidden"][a:b], entry["prompt_len"],
                     t["greedy"][a:b] if "greedy" in t else None, entry["dropped"],
                     t["sample"][a:b] if "sample" in t else None, entry.get("prompt"))


def check_item(meta: dict[str, Any], i: int, item: TraceItem) -> None:
    """Item ``i``'s rules: its sha256, its prompt identity's sha256 against its prompt tokens, token
    range, finiteness and (speculative traces) the trajectory's self-consistency: ``tokens[p + 1]
    == argmax[p]`` (greedy) or ``== sample[p]`` (sampled) for every generated position."""
    from .prompt_id import prompt_sha256

    where, V, entry = f"items[{i}]", meta["vocab_size"], meta["items"][i]
    if item_sha256(item) != entry["sha256"]:
        raise TraceError(f"{where}.sha256", "does not match the item's bytes (a changed or damaged shard)")
    for n in ("tokens", "argmax", *(["sample"] if item.sample is not None else [])):
        x = item.arrays()[n]
        if int(x.min()) < 0 or int(x.max()) >= V:
            bad = int(((x < 0) | (x >= V)).nonzero()[0, 0])
            raise TraceError(f"{where}.{n}", f"position {bad} holds {int(x[bad])}, outside [0, vocab_size={V})")
    if item.prompt is not None and item.prompt["sha256"] != prompt_sha256(item.tokens[: item.prompt_len].tolist()):
        raise TraceError(f"{where}.prompt.sha256", "does not match the item's prompt tokens (tokens[:prompt_len])")
    if item.greedy is not None:
        g, P = item.greedy, item.prompt_len
        if not torch.equal(g[:, 0], item.argmax):
            raise TraceError(f"{where}.greedy", "column 0 must equal argmax")
        tail = g[P:]
        if int(tail.min()) < 0 or int(tail.max()) >= V:
            raise TraceError(f"{where}.greedy", f"rows >= prompt_len must hold tokens in [0, vocab_size={V})")
        if bool((g[:P, 1:] != NOT_RECORDED).any()):
            raise TraceError(f"{where}.greedy", f"columns >= 1 of rows < prompt_len must be {NOT_RECORDED}")
    if not bool(torch.isfinite(item.hidden).all()):
        bad = int((~torch.isfinite(item.hidden)).any(dim=1).nonzero()[0, 0])
        raise TraceError(f"{where}.hidden", f"position {bad} holds a NaN or inf")
    if meta["mode"] == "speculative":
        P = item.prompt_len
        name, nxt = ("sample", item.sample) if item.sample is not None else ("argmax", item.argmax)
        diff = (item.tokens[P:] != nxt[P - 1 : -1]).nonzero()
        if diff.numel():
            p = P - 1 + int(diff[0, 0])
            raise TraceError(f"{where}.{name}", f"position {p} predicts {int(nxt[p])} but the trajectory "
                             f"continues with {int(item.tokens[p + 1])} (tokens[p + 1] must equal {name}[p])")


def iter_items(directory: str, meta: dict[str, Any]) -> Iterator[tuple[int, TraceItem]]:
    """Every item, checked (``check_item``), shard by shard."""
    by_shard: dict[int, list[int]] = {}
    for i, e in enumerate(meta["items"]):
        by_shard.setdefault(e["shard"], []).append(i)
    for s in range(len(meta["shards"])):
        t = read_shard(directory, meta, s)
        for i in by_shard.get(s, []):
            item = item_from_shard(t, meta["items"][i])
            check_item(meta, i, item)
            yield i, item


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


def open_trace(directory: str) -> Trace:
    """Read and check the whole trace at ``directory``: the metadata, every shard's arrays and
    every item's rules (``TraceError``, a ``ValueError``, naming the field of the first problem)."""
    meta = read_meta(directory)
    items = [item for _, item in iter_items(directory, meta)]
    return Trace(directory, meta, file_sha256(os.path.join(directory, META)), items)


def problems(directory: str) -> list[str]:
    """What is wrong with the trace at ``directory``, one line per problem, field by field
    (empty: a valid trace). The metadata is checked first (a broken record stops there); then
    each shard and each item, every problem reported."""
    try:
        meta = read_meta(directory)
    except TraceError as e:
        return [str(e)]
    out = []
    by_shard: dict[int, list[int]] = {}
    for i, e in enumerate(meta["items"]):
        by_shard.setdefault(e["shard"], []).append(i)
    for s in range(len(meta["shards"])):
        try:
            t = read_shard(directory, meta, s)
        except TraceError as e:
            out.append(str(e))
            continue
        for i in by_shard.get(s, []):
            try:
                check_item(meta, i, item_from_shard(t, meta["items"][i]))
            except TraceError as e:
                out.append(str(e))
    return out
