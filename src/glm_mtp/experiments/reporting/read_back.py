"""Result files read back as input (issue 49): a finished stop sweep's ``sweep.json`` that
``sweep.rescore`` recomputes, checked field by field before any work. A bool is never taken for
an integer, a null never for a number; the JSON's size and nesting are bounded before it is
parsed into objects the checks walk.

- ``read_json_file(path, key)``: a file's JSON, ``ValueError`` naming ``key`` and the file for a
  missing, unreadable, undecodable, oversized or too deeply nested one;
- ``check_sweep_record(obj, where)``: the fields ``stop_sweep.rescore`` reads.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, TypeGuard

MAX_BYTES = 256 << 20  # a sweep.json of thousands of prompts is a few MB
MAX_DEPTH = 32  # sweep.json nests 6 deep; summaries and traces about as much


def json_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (strings skipped), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def read_json_file(path: object, key: str, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES,
                   allow_nan: bool = True) -> Any:
    """The JSON value in file ``path``; ``ValueError`` naming ``key`` and the file otherwise.
    ``allow_nan``: Python's ``NaN`` / ``Infinity`` constants parse (the package writes them in
    records, e.g. a correlation over no rounds; the checked fields refuse them)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{key} must be a file path, got {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{key}: {path} is not a file")
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise ValueError(f"{key}: {path} holds {size} bytes, past the bound of {max_bytes}")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{key}: {path} is not readable ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{key}: {path} is not UTF-8 (byte {e.start})") from None
    if json_depth(text) > max_depth:
        raise ValueError(f"{key}: {path} nests deeper than {max_depth} levels")
    try:
        return json.loads(text) if allow_nan else json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{key}: {path} is not valid JSON ({e})"[:300]) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _int(x: Any, lo: int = 0, hi: int | None = None) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo and (hi is None or x <= hi)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


SWEEP_RULES = ("none", "oracle", "prob", "cumprob", "margin")


def check_sweep_record(obj: Any, where: str) -> dict[str, Any]:
    """A stop sweep's record as ``rescore`` reads it: ``num_drafts`` K >= 1; ``rows`` a non-empty
    list, each with ``name`` (text), ``rule`` (one of ``SWEEP_RULES``), ``threshold`` (null for
    none and oracle, else a finite number), ``num_drafts`` in [1, K] and ``counts``: ``committed``
    P >= 1 integers >= 0 and ``widths`` P lists of num_drafts + 1 integers >= 0, a prompt's
    committed tokens at most its steps x (num_drafts + 1). ``ValueError`` naming the field."""
    def bad(field: str, rule: str, got: Any) -> ValueError:
        return ValueError(f"{where}: {field} must be {rule}, got {got!r}"[:300])

    if not isinstance(obj, dict):
        raise bad("the record", "a JSON object (a stop sweep's sweep.json)", type(obj).__name__)
    K = obj.get("num_drafts")
    if not _int(K, 1):
        raise bad("num_drafts", "an integer >= 1", K)
    rows = obj.get("rows")
    if not isinstance(rows, list) or not rows:
        raise bad("rows", "a non-empty list", rows)
    for i, r in enumerate(rows):
        at = f"rows[{i}]"
        if not isinstance(r, dict):
            raise bad(at, "an object", r)
        if not isinstance(r.get("name"), str) or not r["name"]:
            raise bad(f"{at}.name", "non-empty text", r.get("name"))
        if r.get("rule") not in SWEEP_RULES:
            raise bad(f"{at}.rule", f"one of {', '.join(SWEEP_RULES)}", r.get("rule"))
        t = r.get("threshold", "missing")
        if (r["rule"] in ("none", "oracle") and t is not None) or (r["rule"] not in ("none", "oracle")
                                                                    and not _number(t)):
            raise bad(f"{at}.threshold", "null for none and oracle, a finite number for a rule", t)
        k = r.get("num_drafts")
        if not _int(k, 1, K):
            raise bad(f"{at}.num_drafts", f"an integer in [1, num_drafts={K}]", k)
        counts = r.get("counts")
        if not isinstance(counts, dict):
            raise bad(f"{at}.counts", "an object with committed and widths", counts)
        committed, widths = counts.get("committed"), counts.get("widths")
        if not isinstance(committed, list) or not committed or not all(_int(x) for x in committed):
            raise bad(f"{at}.counts.committed", "a non-empty list of integers >= 0", committed)
        if not isinstance(widths, list) or len(widths) != len(committed):
            raise bad(f"{at}.counts.widths", f"one list per prompt ({len(committed)})", widths)
        for p, (c, w) in enumerate(zip(committed, widths)):
            if not isinstance(w, list) or len(w) != k + 1 or not all(_int(x) for x in w):
                raise bad(f"{at}.counts.widths[{p}]", f"num_drafts + 1 = {k + 1} integers >= 0", w)
            if c > sum(w) * (k + 1):
                raise bad(f"{at}.counts.committed[{p}]", f"at most steps x (num_drafts + 1) = {sum(w) * (k + 1)}", c)
    return obj
