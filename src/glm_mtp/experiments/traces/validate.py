"""The trace validator (DESIGN.md §11, docs/traces.md "A trace is input"): ``trace.json`` and its
shards read as untrusted data. Every rule of the format is checked here, in this one module, and
both ``python -m glm_mtp.experiments.traces check`` and the replay (``open_trace``, which
``replay_run.open_for_replay`` calls) run it.

Four stages, each before the next reads anything:

1. ``read_bounded_json``: ``trace.json`` a regular file in the trace's folder (not a link), at most
   ``MAX_META_BYTES``, UTF-8, nested at most ``MAX_DEPTH`` deep (counted on the text, before the
   parser recurses), every integer within int64 (its digits counted before it is converted),
   every float finite and no ``NaN`` / ``Infinity``, no key twice in an object, no string longer
   than ``MAX_STRING``;
2. ``check_meta``: every field against the format: types (a bool is never an integer), ranges,
   required and optional keys, no unknown key, the version rule, and the rules across fields
   (items tile their shards, ``forwards.total`` the sum, one cost per k, ...);
3. ``read_shard_header``: each shard the regular file (not a link) ``trace.json`` names inside the
   folder, its safetensors header read alone (8 bytes and the header, never the arrays) and
   checked: exactly the format's arrays with their dtypes and shapes, offsets that tile the file
   to its last byte (a truncated shard is refused here);
4. ``check_item``: each item's bytes, read one item at a time (a slice of its shard): its sha256,
   its prompt's sha256, token range, finiteness and the trajectory's self-consistency.

``problems`` lists every problem, one line each (the metadata stops at its first; a shard whose
header fails skips its items); ``open_trace`` raises the first of the same list (the same
generator), so what ``check`` calls valid replays, and the first line ``check`` prints is what a
replay refuses. Each line names the file, the field and the rule:
``trace.json: items[3].length: must be an integer in [2, 2147483647], got -1``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .format import (FORMAT, HIDDEN_DTYPES, META, MODES, NOT_RECORDED, READ_VERSIONS, Trace, TraceError, TraceItem,
                     is_sampled, item_sha256, shard_name)

MAX_META_BYTES = 64 << 20  # trace.json: about 300 bytes per item, so some 200 000 items
MAX_DEPTH = 8  # trace.json nests 4 deep (items[i].prompt); a shard header 3
MAX_STRING = 4096  # characters of any string (a path is at most PATH_MAX)
MAX_INT_DIGITS = 19  # int64
MAX_FLOAT_CHARS = 64  # a float64 needs 24 characters; an engine's longer repr is still far below
MAX_HEADER_BYTES = 1 << 20  # a shard's safetensors header: 5 arrays, some 500 bytes
INT32_MAX = (1 << 31) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_HIDDEN = 1 << 16
MAX_DRAFTS = 64
MAX_SHAPE_RANK = 8
SAFETENSORS_DTYPES = {"I32": torch.int32, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F64": torch.float64}


# ------------------------------------------------------------------------------------------------
# Stage 1: bounded JSON


class _Refused:
    """What the parser's hooks return for a value the bounds refuse (the walk names its field)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _parse_int(text: str) -> Any:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:  # before int(): no quadratic conversion of a huge literal
        return _Refused(f"an integer of {digits} digits, past int64")
    value = int(text)
    if not INT64[0] <= value <= INT64[1]:
        return _Refused(f"the integer {value}, past int64")
    return value


def _parse_float(text: str) -> Any:
    if len(text) > MAX_FLOAT_CHARS:
        return _Refused(f"a number literal of {len(text)} characters (at most {MAX_FLOAT_CHARS})")
    value = float(text)
    if not math.isfinite(value):
        return _Refused(f"the number {text} (past float64: not finite)")
    return value


def _parse_constant(text: str) -> Any:
    return _Refused(f"{text} (not a JSON number)")


def _object(pairs: list[tuple[str, Any]]) -> Any:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            return _Refused(f"an object holding the key {k[:80]!r} twice")
        out[k] = v
    return out


# A JSON string (escapes skipped) or one bracket: the text's nesting is counted over these alone.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def json_depth(text: str, bound: int) -> int:
    """The deepest bracket nesting of JSON ``text`` (strings skipped), without parsing it; stops
    counting once past ``bound``."""
    depth = deepest = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > bound:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def _first_refused(x: Any, path: str) -> tuple[str, str] | None:
    """The first value under ``x`` the bounds refuse: ``(its field path, why)``; the nesting is
    already bounded, so this recursion is too."""
    if isinstance(x, _Refused):
        return path or "the record", x.why
    if isinstance(x, str):
        return (path or "the record", f"a string of {len(x)} characters (at most {MAX_STRING})") if len(
            x) > MAX_STRING else None
    if isinstance(x, dict):
        for k, v in x.items():
            where = f"{path}.{k}" if path else k
            if len(k) > MAX_STRING:
                return path or "the record", f"a key of {len(k)} characters (at most {MAX_STRING})"
            found = _first_refused(v, where)
            if found:
                return found
    if isinstance(x, list):
        for i, v in enumerate(x):
            found = _first_refused(v, f"{path}[{i}]")
            if found:
                return found
    return None


def parse_bounded_json(data: bytes, file: str, depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``data`` (the bytes of ``file``, already within its size bound), every
    bound of stage 1 checked: ``TraceError`` naming ``file`` and, for a value, its field."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError("the record", f"is not UTF-8 (byte {e.start})", file=file) from None
    if json_depth(text, depth) > depth:
        raise TraceError("the record", f"nests deeper than {depth} levels (the bound: the format nests less)",
                         file=file)
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                           object_pairs_hook=_object)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise TraceError("the record", f"is not valid JSON ({e})"[:200], file=file) from None
    found = _first_refused(value, "")
    if found:
        raise TraceError(found[0], f"holds {found[1]}", file=file)
    return value


def _regular_file(directory: str, name: str, field: str) -> int:
    """``name`` in ``directory`` as a regular file, never a link (a link may point out of the
    trace's folder): its size. ``TraceError`` naming ``field`` and the file otherwise."""
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise TraceError(field, f"{path} is missing", file=name) from None
    except OSError as e:
        raise TraceError(field, f"{path} cannot be read ({e.strerror})", file=name) from None
    if stat.S_ISLNK(st.st_mode):
        raise TraceError(field, "is a symbolic link: a trace's files are regular files inside its folder (a link may "
                         "point out of it)", file=name)
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(field, "is not a regular file", file=name)
    return st.st_size


def _read(directory: str, name: str, field: str, start: int, size: int) -> bytes:
    """``size`` bytes of ``name`` from ``start``, opened without following a link."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.lseek(fd, start, os.SEEK_SET)
            chunks, left = [], size
            while left:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    except OSError as e:
        raise TraceError(field, f"cannot be read ({e.strerror})", file=name) from None


def read_trace_json(directory: str) -> tuple[dict[str, Any], str]:
    """``trace.json`` of ``directory`` parsed within the bounds (stage 1) and checked field by
    field (``check_meta``); with the sha256 of the bytes checked. ``TraceError`` otherwise."""
    if not isinstance(directory, str) or not os.path.isdir(directory):
        raise TraceError("trace.path", f"{directory} is not a directory")
    size = _regular_file(directory, META, "the record")
    if size > MAX_META_BYTES:
        raise TraceError("the record", f"holds {size} bytes, past the bound of {MAX_META_BYTES}", file=META)
    data = _read(directory, META, "the record", 0, size)
    meta = parse_bounded_json(data, META)
    check_meta(meta)
    return meta, hashlib.sha256(data).hexdigest()


def read_meta(directory: str) -> dict[str, Any]:
    """``trace.json`` of ``directory``, parsed and every field checked (``TraceError``)."""
    return read_trace_json(directory)[0]


# ------------------------------------------------------------------------------------------------
# Stage 2: the fields of trace.json


def _int(lo: int, hi: int = INT64[1]) -> tuple[str, Callable[[Any], bool]]:
    return (f"an integer in [{lo}, {hi}]" if hi != INT64[1] else f"an integer >= {lo}",
            lambda x: isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi)


def _is_hex(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _or_null(rule: tuple[str, Callable[[Any], bool]]) -> tuple[str, Callable[[Any], bool]]:
    return f"null or {rule[0]}", lambda x: x is None or rule[1](x)


def _one_of(values: Any) -> tuple[str, Callable[[Any], bool]]:
    return f"one of {tuple(values)}", lambda x: isinstance(x, str) and x in values


HEX = ("a sha256 hex string (64 lowercase hex digits)", _is_hex)
TEXT = ("a string", lambda x: isinstance(x, str))
NAME = ("a non-empty string", lambda x: isinstance(x, str) and bool(x))
POSITIVE = ("a finite number > 0", lambda x: _is_number(x) and x > 0)
STR_MAP = ("an object of strings", lambda x: isinstance(x, dict) and all(isinstance(v, str) for v in x.values()))
OBJECT = ("an object", lambda x: isinstance(x, dict))
LIST = ("a non-empty list", lambda x: isinstance(x, list) and bool(x))


@dataclass(frozen=True)
class Field:
    """One key of an object in ``trace.json``: ``rule`` (what its value must be, as a refusal
    states it, and the test), ``required`` (False: it may be left out)."""

    name: str
    rule: tuple[str, Callable[[Any], bool]]
    required: bool = True


def _optional(name: str, rule: tuple[str, Callable[[Any], bool]]) -> Field:
    return Field(name, rule, required=False)


TOP = (Field("format", (repr(FORMAT), lambda x: x == FORMAT)),
       Field("version", (f"one of {READ_VERSIONS} (the versions this package reads)",
                         lambda x: isinstance(x, int) and not isinstance(x, bool) and x in READ_VERSIONS)),
       Field("mode", _one_of(MODES)),
       Field("vocab_size", _int(1, INT32_MAX)),
       Field("hidden_size", _int(1, MAX_HIDDEN)),
       Field("hidden_dtype", _one_of(tuple(HIDDEN_DTYPES))),
       Field("max_drafts", _int(1, MAX_DRAFTS)),
       Field("target", OBJECT),
       Field("tokenizer_sha256", _or_null(HEX)),
       _optional("prompts", OBJECT),
       Field("generation", OBJECT),
       _optional("truncation", OBJECT),
       _optional("forwards", OBJECT),
       _optional("costs", _or_null(OBJECT)),
       _optional("recorded_by", OBJECT),
       Field("shards", LIST),
       Field("items", LIST))
TARGET = (_optional("implementation", NAME), _optional("numerics", NAME), Field("target_config_sha256", HEX),
          _optional("dtype", NAME), _optional("checkpoint", _or_null(TEXT)),
          _optional("checkpoint_sha256", _or_null(HEX)), _optional("corpus_sha256", _or_null(HEX)),
          _optional("transformers_version", NAME), _optional("class", NAME), _optional("model_type", NAME),
          _optional("config_sha256", HEX), _optional("device", NAME), _optional("device_map", STR_MAP),
          _optional("topk_ties", NAME))
PROMPTS = (_optional("source", NAME), _optional("num_prompts", _int(1)), _optional("recorded_items", _int(1)),
           _optional("prompt_tokens", _or_null(_int(1))), _optional("seed", _or_null(_int(*INT64))),
           _optional("windows_sha256", HEX), _optional("path", _or_null(TEXT)),
           _optional("file_sha256", _or_null(HEX)))
SAMPLER = (Field("name", NAME), Field("version", _int(1)))
# the budget fields of ``generation`` (both versions); version 2 adds the sampler's
GENERATION_BUDGET = (_optional("max_new_tokens", _or_null(_int(1))), _optional("continuation", _or_null(_int(1))),
                     _optional("batch_size", _int(1)))
GENERATION = {1: (Field("temperature", ("0 in a version-1 trace (greedy)", lambda x: _is_number(x) and x == 0)),
                  *GENERATION_BUDGET),
              2: (Field("temperature", ("a finite number >= 0", lambda x: _is_number(x) and x >= 0)),
                  Field("top_p", _or_null(("a number in (0, 1]", lambda x: _is_number(x) and 0 < x <= 1))),
                  Field("top_k", _or_null(_int(1))), Field("seed", _or_null(_int(*INT64))),
                  Field("sampler", _or_null(OBJECT)), *GENERATION_BUDGET)}
TRUNCATION = tuple(Field(n, _int(0)) for n in ("items", "positions_dropped", "items_dropped"))
FORWARDS = tuple(Field(n, _int(0)) for n in ("generation", "teacher_forced", "total"))
COSTS = (Field("target_step_ms", POSITIVE), Field("verify_ms", LIST), _optional("repeats", _int(1)),
         _optional("context", _int(2)), _optional("source", TEXT))
RECORDED_BY = (_optional("package", NAME), _optional("git_commit", _or_null(TEXT)))
SHARD = (Field("file", TEXT), Field("rows", _int(1, INT32_MAX)))
ITEM_FIELDS = (Field("shard", _int(0)), Field("start", _int(0, INT32_MAX)), Field("length", _int(2, INT32_MAX)),
               Field("prompt_len", _int(1, INT32_MAX)), Field("dropped", _int(0)), Field("sha256", HEX))
ITEM = {1: ITEM_FIELDS, 2: (*ITEM_FIELDS, Field("prompt", OBJECT))}
PROMPT = (Field("source", NAME), Field("index", _int(0)), Field("sha256", HEX))


def _got(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def check_fields(obj: Any, where: str, fields: tuple[Field, ...]) -> None:
    """``obj`` (at field path ``where``) is an object holding every required field, no key
    outside ``fields``, and each value by its rule: ``TraceError`` naming the first that is not."""
    if not isinstance(obj, dict):
        raise TraceError(where or "the record", f"must be an object, got {_got(obj)}", file=META)
    names = [f.name for f in fields]
    for key in obj:
        if key not in names:
            raise TraceError(f"{where}.{key}" if where else key, f"is not a field of the format (it holds "
                             f"{', '.join(names)})"[:300], file=META)
    for f in fields:
        at = f"{where}.{f.name}" if where else f.name
        if f.name not in obj:
            if f.required:
                raise TraceError(at, f"is missing: it must be {f.rule[0]}", file=META)
            continue
        if not f.rule[1](obj[f.name]):
            raise TraceError(at, f"must be {f.rule[0]}, got {_got(obj[f.name])}", file=META)


def check_meta(meta: Any) -> None:
    """Every field of a parsed ``trace.json`` by the format (module docstring, docs/traces.md):
    ``TraceError`` naming the first field that breaks a rule. ``format`` and ``version`` first
    (a foreign file or another version is named as such), then every field in the format's
    order, then the rules across fields."""
    if not isinstance(meta, dict):
        raise TraceError("the record", f"must be a JSON object, got {type(meta).__name__}", file=META)
    for f in TOP[:2]:  # a foreign record or another version: named before any other field's rule
        if f.name not in meta or not f.rule[1](meta[f.name]):
            raise TraceError(f.name, f"must be {f.rule[0]}, got {_got(meta.get(f.name, 'nothing (missing)'))}",
                             file=META)
    check_fields(meta, "", TOP)
    K = meta["max_drafts"]
    check_fields(meta["target"], "target", TARGET)
    if "prompts" in meta:
        check_fields(meta["prompts"], "prompts", PROMPTS)
    check_generation(meta)
    for name, fields in (("truncation", TRUNCATION), ("forwards", FORWARDS), ("recorded_by", RECORDED_BY)):
        if name in meta:
            check_fields(meta[name], name, fields)
    if "forwards" in meta:
        f = meta["forwards"]
        if f["total"] != f["generation"] + f["teacher_forced"]:
            raise TraceError("forwards.total", f"must be generation + teacher_forced = "
                             f"{f['generation'] + f['teacher_forced']}, got {f['total']}", file=META)
    if meta.get("costs") is not None:
        costs = meta["costs"]
        check_fields(costs, "costs", COSTS)
        v = costs["verify_ms"]
        if len(v) != K or not all(POSITIVE[1](x) for x in v):
            raise TraceError("costs.verify_ms", f"must be max_drafts={K} finite numbers > 0 (one per k = 1..{K}), got "
                             f"{_got(v)}", file=META)
    shards, items = meta["shards"], meta["items"]
    for s, sh in enumerate(shards):
        check_fields(sh, f"shards[{s}]", SHARD)
        if sh["file"] != shard_name(s):
            raise TraceError(f"shards[{s}].file", f"must be {shard_name(s)!r} (shard {s}'s name: a file inside the "
                             f"trace's folder), got {_got(sh['file'])}", file=META)
    check_items(meta)
    prompts = meta.get("prompts") or {}
    if prompts.get("recorded_items") is not None and prompts["recorded_items"] != len(items):
        raise TraceError("prompts.recorded_items", f"must be the number of items, {len(items)}, got "
                         f"{prompts['recorded_items']}", file=META)
    if prompts.get("num_prompts") is not None and prompts["num_prompts"] < len(items):
        raise TraceError("prompts.num_prompts", f"must be at least the number of items, {len(items)}, got "
                         f"{prompts['num_prompts']}", file=META)


def check_generation(meta: dict[str, Any]) -> None:
    """``generation``'s rules. Version 1: ``temperature`` 0 and no sampler fields. Version 2:
    ``temperature`` a finite number >= 0; at 0 (greedy) ``top_p``, ``top_k``, ``seed`` and
    ``sampler`` null; above 0 (a sampled trace, speculative mode only) ``top_p`` null or in (0, 1],
    ``top_k`` null or an integer >= 1, ``seed`` an integer (int64) and ``sampler`` ``{"name": str,
    "version": int >= 1}``. Both: ``continuation`` null in teacher-forced mode and, where given with
    ``max_new_tokens`` in speculative mode, ``max_new_tokens + max_drafts - 1``."""
    g = meta["generation"]
    check_fields(g, "generation", GENERATION[meta["version"]])
    mode, K = meta["mode"], meta["max_drafts"]
    if meta["version"] >= 2:
        if g["temperature"] == 0:
            for key in ("top_p", "top_k", "seed", "sampler"):
                if g[key] is not None:
                    raise TraceError(f"generation.{key}", f"must be null in a greedy trace (temperature 0), got "
                                     f"{_got(g[key])}", file=META)
        else:
            if mode != "speculative":
                raise TraceError("generation.temperature", f"a sampled trace (temperature > 0) is speculative; mode "
                                 f"is {mode!r}", file=META)
            if g["seed"] is None:
                raise TraceError("generation.seed", "must be an integer (int64) in a sampled trace, got None",
                                 file=META)
            if g["sampler"] is None:
                raise TraceError("generation.sampler", "must be {'name': str, 'version': int >= 1} in a sampled "
                                 "trace, got None", file=META)
            check_fields(g["sampler"], "generation.sampler", SAMPLER)
    cont, new = g.get("continuation"), g.get("max_new_tokens")
    if mode == "teacher_forced" and cont is not None:
        raise TraceError("generation.continuation", f"must be null in a teacher-forced trace (it scores the text), "
                         f"got {cont}", file=META)
    if mode == "speculative" and cont is not None and new is not None and cont != new + K - 1:
        raise TraceError("generation.continuation", f"must be max_new_tokens + max_drafts - 1 = {new + K - 1} (the "
                         f"tokens pass 1 generates), got {cont}", file=META)


def check_items(meta: dict[str, Any]) -> None:
    """Each entry of ``items``: its fields, ``prompt_len < length``, its prompt identity (version
    2), its shard and its place (items tile their shard in order, each shard's ``rows`` the sum
    of its items' lengths) and, in a speculative trace whose ``generation.continuation`` is
    given, ``length + dropped = prompt_len + continuation`` (every item was generated that far)."""
    shards, version = meta["shards"], meta["version"]
    cont = meta["generation"].get("continuation") if meta["mode"] == "speculative" else None
    ends = [0] * len(shards)
    for i, it in enumerate(meta["items"]):
        where = f"items[{i}]"
        check_fields(it, where, ITEM[version])
        if not it["prompt_len"] < it["length"]:
            raise TraceError(f"{where}.prompt_len", f"must be below length={it['length']}, got {it['prompt_len']}",
                             file=META)
        if version >= 2:
            check_fields(it["prompt"], f"{where}.prompt", PROMPT)
        s = it["shard"]
        if s >= len(shards):
            raise TraceError(f"{where}.shard", f"must name one of the {len(shards)} shards (< {len(shards)}), got {s}",
                             file=META)
        if it["start"] != ends[s]:
            raise TraceError(f"{where}.start", f"items must tile their shard in order: expected {ends[s]} (shard {s}'s "
                             f"rows so far), got {it['start']}", file=META)
        ends[s] += it["length"]
        if ends[s] > shards[s]["rows"]:
            raise TraceError(f"{where}.length", f"runs past shards[{s}].rows={shards[s]['rows']} (its end is row "
                             f"{ends[s]})", file=META)
        if cont is not None and it["length"] + it["dropped"] != it["prompt_len"] + cont:
            raise TraceError(f"{where}.dropped", f"length + dropped must be prompt_len + generation.continuation = "
                             f"{it['prompt_len'] + cont}, got {it['length']} + {it['dropped']}", file=META)
    for s, sh in enumerate(shards):
        if ends[s] != sh["rows"]:
            raise TraceError(f"shards[{s}].rows", f"is {sh['rows']}, its items hold {ends[s]} rows", file=META)


# ------------------------------------------------------------------------------------------------
# Stage 3: shard headers


def shard_arrays(meta: dict[str, Any], s: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The arrays shard ``s`` must hold, each with its dtype and shape (rows, hidden_size,
    max_drafts + 1 from ``trace.json``)."""
    rows, H, K = meta["shards"][s]["rows"], meta["hidden_size"], meta["max_drafts"]
    out = {"tokens": (torch.int32, (rows,)), "argmax": (torch.int32, (rows,)),
           "hidden": (HIDDEN_DTYPES[meta["hidden_dtype"]], (rows, H))}
    if is_sampled(meta):
        out["sample"] = (torch.int32, (rows,))
    if meta["mode"] == "teacher_forced":
        out["greedy"] = (torch.int32, (rows, K + 1))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_shard_header(directory: str, meta: dict[str, Any], s: int) -> dict[str, Any]:
    """Shard ``s``'s safetensors header, read alone (the 8-byte length and the JSON header, within
    ``MAX_HEADER_BYTES``) and checked against ``trace.json``: the file regular (not a link), its
    arrays exactly ``shard_arrays``, each with its dtype and shape, byte ranges the size of their
    arrays that tile the data to the file's last byte. ``TraceError`` naming the shard's file."""
    name, where = shard_name(s), f"shards[{s}]"
    size = _regular_file(directory, name, f"{where}.file")
    if size < 8:
        raise TraceError(f"{where}.file", f"holds {size} bytes: not a safetensors file (truncated)", file=name)
    (n,) = struct.unpack("<Q", _read(directory, name, f"{where}.file", 0, 8))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise TraceError(f"{where}.file", f"declares a header of {n} bytes in a file of {size} (at most "
                         f"{min(MAX_HEADER_BYTES, size - 8)}): not a safetensors file, or truncated", file=name)
    header = parse_bounded_json(_read(directory, name, f"{where}.file", 8, n), name, depth=3)
    if not isinstance(header, dict):
        raise TraceError(f"{where}.file", "a safetensors header is a JSON object", file=name)
    want = shard_arrays(meta, s)
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise TraceError(f"{where}.__metadata__", "must be an object of strings (safetensors' format)", file=name)
    held = sorted(k for k in header if k != "__metadata__")
    if set(held) != set(want):
        raise TraceError(where, f"{name} must hold exactly {sorted(want)}, holds {held}", file=name)
    spans = []
    for a in held:
        entry, at = header[a], f"{where}.{a}"
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
            raise TraceError(at, "must be {'dtype', 'shape', 'data_offsets'} (a safetensors entry), got "
                             f"{_got(entry)}", file=name)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        want_dtype, want_shape = want[a]
        if (SAFETENSORS_DTYPES.get(dtype) if isinstance(dtype, str) else None) != want_dtype:
            got = (_dtype_name(SAFETENSORS_DTYPES[dtype]) if isinstance(dtype, str) and dtype in SAFETENSORS_DTYPES
                   else _got(dtype))
            raise TraceError(at, f"dtype must be {_dtype_name(want_dtype)} (hidden_dtype / the format), got {got}",
                             file=name)
        if not (isinstance(shape, list) and len(shape) <= MAX_SHAPE_RANK
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise TraceError(at, f"shape must be a list of sizes >= 0, got {_got(shape)}", file=name)
        if tuple(shape) != want_shape:
            raise TraceError(at, f"shape must be {want_shape} (rows, hidden_size, max_drafts + 1), got {tuple(shape)}",
                             file=name)
        nbytes = math.prod(want_shape) * want_dtype.itemsize
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[1] - offsets[0] == nbytes):
            raise TraceError(at, f"data_offsets must be [begin, begin + {nbytes}] (its shape's bytes), got "
                             f"{_got(offsets)}", file=name)
        spans.append((offsets[0], offsets[1], a))
    data = size - 8 - n
    end = 0
    for begin, stop, a in sorted(spans):
        if begin != end:
            raise TraceError(f"{where}.{a}", f"data_offsets must start at byte {end} (the arrays tile the data), got "
                             f"{begin}", file=name)
        end = stop
    if end != data:
        raise TraceError(f"{where}.file", f"holds {data} bytes of data, its header's arrays {end}: "
                         f"{'truncated' if end > data else 'trailing bytes'}", file=name)
    return header


# ------------------------------------------------------------------------------------------------
# Stage 4: each item's bytes


def read_item(f: Any, meta: dict[str, Any], i: int) -> TraceItem:
    """Item ``i`` sliced out of its shard (``f``: the shard opened with ``safetensors.safe_open``;
    only the item's rows are read)."""
    entry = meta["items"][i]
    a, b = entry["start"], entry["start"] + entry["length"]
    # cloned: a safetensors slice may be a view of the whole shard's buffer, which an item kept
    # (or the last one read, while the next shard is opened) would hold alive
    return item_from_rows({n: f.get_slice(n)[a:b].clone() for n in f.keys()}, entry)


def item_from_rows(rows: dict[str, torch.Tensor], entry: dict[str, Any]) -> TraceItem:
    """The item whose ``trace.json`` entry is ``entry`` from its rows of its shard's arrays
    (``rows[name]``: the item's ``length`` rows; ``greedy`` and ``sample`` where the trace has them)."""
    return TraceItem(rows["tokens"], rows["argmax"], rows["hidden"], entry["prompt_len"], rows.get("greedy"),
                     entry["dropped"], rows.get("sample"), entry.get("prompt"))


def check_item(meta: dict[str, Any], i: int, item: TraceItem) -> None:
    """Item ``i``'s rules: its sha256, its prompt identity's sha256 against its prompt tokens, token
    range, finiteness and (speculative traces) the trajectory's self-consistency: ``tokens[p + 1]
    == argmax[p]`` (greedy) or ``== sample[p]`` (sampled) for every generated position.
    ``TraceError`` naming the item's shard file."""
    from .prompt_id import prompt_sha256

    where, V, entry = f"items[{i}]", meta["vocab_size"], meta["items"][i]
    file = shard_name(entry["shard"])
    if item_sha256(item) != entry["sha256"]:
        raise TraceError(f"{where}.sha256", "does not match the item's bytes (a changed or damaged shard)", file=file)
    for n in ("tokens", "argmax", *(["sample"] if item.sample is not None else [])):
        x = item.arrays()[n]
        if int(x.min()) < 0 or int(x.max()) >= V:
            bad = int(((x < 0) | (x >= V)).nonzero()[0, 0])
            raise TraceError(f"{where}.{n}", f"position {bad} holds {int(x[bad])}, outside [0, vocab_size={V})",
                             file=file)
    if item.prompt is not None and item.prompt["sha256"] != prompt_sha256(item.tokens[: item.prompt_len].tolist()):
        raise TraceError(f"{where}.prompt.sha256", "does not match the item's prompt tokens (tokens[:prompt_len])",
                         file=file)
    if item.greedy is not None:
        g, P = item.greedy, item.prompt_len
        if not torch.equal(g[:, 0], item.argmax):
            raise TraceError(f"{where}.greedy", "column 0 must equal argmax", file=file)
        tail = g[P:]
        if int(tail.min()) < 0 or int(tail.max()) >= V:
            raise TraceError(f"{where}.greedy", f"rows >= prompt_len must hold tokens in [0, vocab_size={V})",
                             file=file)
        if bool((g[:P, 1:] != NOT_RECORDED).any()):
            raise TraceError(f"{where}.greedy", f"columns >= 1 of rows < prompt_len must be {NOT_RECORDED}", file=file)
    if not bool(torch.isfinite(item.hidden).all()):
        bad = int((~torch.isfinite(item.hidden)).any(dim=1).nonzero()[0, 0])
        raise TraceError(f"{where}.hidden", f"position {bad} holds a NaN or inf", file=file)
    if meta["mode"] == "speculative":
        P = item.prompt_len
        name, nxt = ("sample", item.sample) if item.sample is not None else ("argmax", item.argmax)
        diff = (item.tokens[P:] != nxt[P - 1 : -1]).nonzero()
        if diff.numel():
            p = P - 1 + int(diff[0, 0])
            raise TraceError(f"{where}.{name}", f"position {p} predicts {int(nxt[p])} but the trajectory "
                             f"continues with {int(item.tokens[p + 1])} (tokens[p + 1] must equal {name}[p])",
                             file=file)


# ------------------------------------------------------------------------------------------------
# The one walk: check reports it, a replay refuses its first line


@dataclass
class Reading:
    """What a walk of a trace read: its checked ``trace.json`` and the sha256 of those bytes
    (None until read), and the items kept (``keep``: a replay holds them; ``check`` does not)."""

    keep: bool
    meta: dict[str, Any] | None = None
    sha256: str | None = None
    items: list[TraceItem] | None = None


def walk(directory: str, reading: Reading) -> Iterator[TraceError]:
    """Every problem of the trace at ``directory``, in order: ``trace.json`` (stages 1-2; its
    first problem ends the walk), then per shard its header (stage 3; a bad one skips its items)
    and each of its items (stage 4), one item's rows in memory at a time."""
    from safetensors import SafetensorError, safe_open

    try:
        meta, sha = read_trace_json(directory)
    except TraceError as e:
        yield e
        return
    reading.meta, reading.sha256, reading.items = meta, sha, []
    by_shard: dict[int, list[int]] = {}
    for i, entry in enumerate(meta["items"]):
        by_shard.setdefault(entry["shard"], []).append(i)
    for s in range(len(meta["shards"])):
        try:
            read_shard_header(directory, meta, s)
        except TraceError as e:
            yield e
            continue
        name = shard_name(s)
        try:
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for i in by_shard.get(s, []):
                    item = read_item(f, meta, i)
                    try:
                        check_item(meta, i, item)
                    except TraceError as e:
                        yield e
                        continue
                    if reading.keep:
                        reading.items.append(item)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:  # a file changed since its header
            yield TraceError(f"shards[{s}].file", f"is not a readable safetensors file ({e})"[:300], file=name)


def problems(directory: str) -> list[str]:
    """What is wrong with the trace at ``directory``, one line per problem (empty: a valid
    trace), each naming the file, the field and the rule (``walk``'s order)."""
    return [str(e) for e in walk(directory, Reading(keep=False))]


def open_trace(directory: str) -> Trace:
    """The trace at ``directory``, every rule checked (``walk``): ``TraceError`` (a
    ``ValueError``), the first line ``problems`` reports, before any item is handed out."""
    reading = Reading(keep=True)
    for e in walk(directory, reading):
        raise e
    assert reading.meta is not None and reading.sha256 is not None and reading.items is not None
    return Trace(directory, reading.meta, reading.sha256, reading.items)
