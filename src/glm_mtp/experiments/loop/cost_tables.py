"""Cost tables: the target's forward at widths 1..W and the drafter's step, in ms, with their source.

The speedup model (``speedup.py``) needs, relative to one decode step, the drafter's step ``c`` and
the extra cost ``v(k)`` of a verify of k + 1 tokens. A cost table holds what an engine measured
on some hardware (DESIGN.md §15), one table per file, JSON:

``format``
    ``"glm-mtp-costs/1"``.
``name``
    the table's name, letters, digits, ``.``, ``_`` and ``-`` (a shipped table's equals its file's
    stem: ``speedup.costs=NAME`` picks it).
``model`` / ``hardware`` / ``engine`` / ``precision`` / ``source``
    non-empty strings: what was timed, on what, by what, in which number format, and the public
    reference (repository#number and the quoted figures) or the user's own note.
``family``
    the drafter family the model belongs to (``glm5``, ``glm5_next``) or null.
``batches``
    a non-empty list, batch sizes strictly increasing, each an object with
    ``batch`` (an int >= 1), ``forward_ms`` (a list of >= 2 finite numbers > 0: a target forward of
    1, 2, .. tokens per sequence, ``forward_ms[0]`` the decode step) and ``draft_step_ms`` (a
    finite number > 0: one draft step of the MTP drafter, head included).
``derived``
    an object: for each number that was derived rather than measured, its path
    (``batches[0].forward_ms[1]``, ``batches[0].draft_step_ms``) and how it was derived. Every
    number not named here was measured.
``derived_from_speedup``
    a list of the ids of published observations (``observations.json``) whose speedup some number
    of the table was derived from; a table with any is no check of the model.
``notes`` (optional)
    a string.

No other key is allowed (a misspelt key is refused, not ignored). A forward wider than the table's
widest is extrapolated linearly from its two widest (``costs_at``), and every use says so.

``observations.json`` (same folder) holds the published (acceptance, speedup) pairs the check
(``cost_check.py``) compares the model with, and the references searched for and not found.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

FORMAT = "glm-mtp-costs/1"
OBSERVATIONS_FORMAT = "glm-mtp-observations/1"
TABLES_DIR = Path(__file__).with_name("costs")
FAMILIES = ("glm5", "glm5_next")
NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
TEXT_KEYS = ("model", "hardware", "engine", "precision", "source")
TABLE_KEYS = {"format", "name", "family", "batches", "derived", "derived_from_speedup", "notes", *TEXT_KEYS}
BATCH_KEYS = {"batch", "forward_ms", "draft_step_ms"}


def _positive(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def read_json(path: str | Path) -> Any:
    """A JSON file's value; ``ValueError`` naming the file when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_table(table: Any, where: str) -> dict[str, Any]:
    """``table`` if it follows the format (module docstring), else ``ValueError`` naming ``where``,
    the field and the rule: the first field that breaks one, checked in the format's order."""
    def bad(field: str, rule: str) -> ValueError:
        return ValueError(f"{where}: {field} {rule} (cost table format {FORMAT}, see glm_mtp.experiments.loop."
                          "cost_tables)")

    if not isinstance(table, dict):
        raise bad("the file", f"must hold a JSON object, got {type(table).__name__}")
    extra = sorted(set(table) - TABLE_KEYS)
    if extra:
        raise bad(f"key {extra[0]!r}", f"is not a field; the fields are {', '.join(sorted(TABLE_KEYS))}")
    if table.get("format") != FORMAT:
        raise bad("format", f"must be {FORMAT!r}, got {table.get('format')!r}")
    if not isinstance(table.get("name"), str) or not NAME_RULE.match(table["name"]):
        raise bad("name", f"must be letters, digits, '.', '_' or '-' (not starting with a sign), got "
                          f"{table.get('name')!r}")
    for key in TEXT_KEYS:
        if not _text(table.get(key)):
            raise bad(key, f"must be a non-empty string, got {table.get(key)!r}")
    if table.get("family") is not None and table.get("family") not in FAMILIES:
        raise bad("family", f"must be one of {', '.join(FAMILIES)} or null, got {table.get('family')!r}")
    batches = table.get("batches")
    if not isinstance(batches, list) or not batches:
        raise bad("batches", "must be a non-empty list of {batch, forward_ms, draft_step_ms}")
    previous = 0
    for i, b in enumerate(batches):
        at = f"batches[{i}]"
        if not isinstance(b, dict):
            raise bad(at, "must be an object {batch, forward_ms, draft_step_ms}")
        extra = sorted(set(b) - BATCH_KEYS)
        if extra:
            raise bad(f"{at}.{extra[0]}", "is not a field; a batch holds batch, forward_ms and draft_step_ms")
        n = b.get("batch")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad(f"{at}.batch", f"must be an int >= 1, got {n!r}")
        if n <= previous:
            raise bad(f"{at}.batch", f"must be larger than the batch before it ({previous}): batch sizes increase, "
                                     "each once")
        previous = n
        fwd = b.get("forward_ms")
        if not isinstance(fwd, list) or len(fwd) < 2:
            raise bad(f"{at}.forward_ms", "must list the forward of widths 1, 2, .. (at least 2) in ms")
        for w, x in enumerate(fwd):
            if not _positive(x):
                raise bad(f"{at}.forward_ms[{w}]", f"must be a finite number of ms > 0, got {x!r}")
        if not _positive(b.get("draft_step_ms")):
            raise bad(f"{at}.draft_step_ms", f"must be a finite number of ms > 0, got {b.get('draft_step_ms')!r}")
    derived = table.get("derived")
    if not isinstance(derived, dict):
        raise bad("derived", "must be an object from the path of each derived number to how it was derived "
                             "({} when every number was measured)")
    paths = number_paths(table)
    for path, how in derived.items():
        if path not in paths:
            raise bad(f"derived[{path!r}]", "names no number of the table (paths look like batches[0].forward_ms[1] "
                                            "or batches[0].draft_step_ms)")
        if not _text(how):
            raise bad(f"derived[{path!r}]", "must say how the number was derived (a non-empty string)")
    dfs = table.get("derived_from_speedup")
    if not isinstance(dfs, list) or not all(_text(x) for x in dfs):
        raise bad("derived_from_speedup", "must be a list of observation ids ([] when no number came from a "
                                          "published speedup)")
    if "notes" in table and not isinstance(table["notes"], str):
        raise bad("notes", "must be a string")
    return table


def number_paths(table: dict[str, Any]) -> list[str]:
    """The path of every number of a (checked) table: ``batches[i].forward_ms[w]``, ``batches[i].draft_step_ms``."""
    out = []
    for i, b in enumerate(table["batches"]):
        out += [f"batches[{i}].forward_ms[{w}]" for w in range(len(b["forward_ms"]))]
        out.append(f"batches[{i}].draft_step_ms")
    return out


def read_table(path: str | Path) -> dict[str, Any]:
    """The cost table in the file at ``path``, checked field by field (``check_table``)."""
    return check_table(read_json(path), str(path))


def shipped_names() -> list[str]:
    """The names of the tables the package ships (``costs/*.json`` but ``observations.json``)."""
    return sorted(p.stem for p in TABLES_DIR.glob("*.json") if p.name != "observations.json")


def shipped_table(name: str) -> dict[str, Any]:
    """A shipped table by name; ``ValueError`` listing the shipped names when there is none."""
    if name not in shipped_names():
        raise ValueError(f"no shipped cost table {name!r}; the shipped tables are {', '.join(shipped_names())}")
    table = read_table(TABLES_DIR / f"{name}.json")
    if table["name"] != name:
        raise ValueError(f"{TABLES_DIR / name}.json: name must equal the file's stem {name!r}, got {table['name']!r}")
    return table


def forward_at(forward_ms: list[float], width: int) -> tuple[float, bool]:
    """The forward of ``width`` tokens: the table's, or beyond its widest W extrapolated linearly
    from widths W - 1 and W (the marginal token's cost held); with whether it was extrapolated."""
    W = len(forward_ms)
    if width <= W:
        return float(forward_ms[width - 1]), False
    step = forward_ms[-1] - forward_ms[-2]
    return float(forward_ms[-1] + (width - W) * step), True


def costs_at(table: dict[str, Any], kmax: int, batch: int | None = None) -> dict[str, Any]:
    """``c`` and ``v(k)`` for k = 1..kmax of one batch size of ``table`` (its first when None):
    ``c = draft_step_ms / forward_ms[0]``, ``v(k) = forward(k + 1) / forward_ms[0] - 1``; with the
    ms they came from, ``extrapolated`` (the k whose forward lies beyond the table's widths) and
    ``source`` ``table:NAME``."""
    rows = {b["batch"]: b for b in table["batches"]}
    if batch is not None and batch not in rows:
        raise ValueError(f"cost table {table['name']!r} has no batch {batch}; it has {sorted(rows)}")
    b = rows[batch] if batch is not None else table["batches"][0]
    step = float(b["forward_ms"][0])
    verify, extrapolated = [], []
    for k in range(1, kmax + 1):
        ms, extra = forward_at(b["forward_ms"], k + 1)
        verify.append(ms)
        if extra:
            extrapolated.append(k)
    return {"c": float(b["draft_step_ms"]) / step, "v": [ms / step - 1.0 for ms in verify], "batch": b["batch"],
            "target_step_ms": step, "draft_step_ms": float(b["draft_step_ms"]), "verify_ms": verify,
            "extrapolated": extrapolated, "source": f"table:{table['name']}", "table": describe(table)}


def per_batch_costs(table: dict[str, Any], kmax: int) -> list[dict[str, Any]]:
    """``costs_at`` for every batch size of the table, smallest first."""
    return [costs_at(table, kmax, b["batch"]) for b in table["batches"]]


def describe(table: dict[str, Any]) -> dict[str, Any]:
    """What a summary records of a table: its name, model, hardware, engine, precision, source,
    batch sizes, derived numbers and whether it was derived from a published speedup."""
    return {k: table.get(k) for k in ("name", "model", "family", "hardware", "engine", "precision", "source")} | {
        "batches": [b["batch"] for b in table["batches"]], "derived": dict(table["derived"]),
        "derived_from_speedup": list(table["derived_from_speedup"])}


def label(table: dict[str, Any]) -> str:
    """``NAME (model on hardware, engine; measured | derived from a published speedup)``: how a line names it."""
    kind = "derived from a published speedup" if table["derived_from_speedup"] else "measured"
    return f"{table['name']} ({table['model']} on {table['hardware']}, {table['engine']}; {kind})"


def format_table(table: dict[str, Any]) -> str:
    """A table as text: its provenance, one line per batch size (ms per width, draft step, c and
    v(k)), and which numbers were derived and how."""
    lines = [f"{table['name']}: {table['model']} on {table['hardware']}, {table['engine']}, {table['precision']}",
             f"  source: {table['source']}"]
    derived = table["derived"]
    for i, b in enumerate(table["batches"]):
        cells = ", ".join(f"{w + 1}: {x:g}{'*' if f'batches[{i}].forward_ms[{w}]' in derived else ''}"
                          for w, x in enumerate(b["forward_ms"]))
        mark = "*" if f"batches[{i}].draft_step_ms" in derived else ""
        c = costs_at(table, len(b["forward_ms"]) - 1, b["batch"])
        v = ", ".join(f"{x:.3f}" for x in c["v"])
        lines.append(f"  batch {b['batch']}: forward ms by width {{{cells}}}; draft step {b['draft_step_ms']:g}{mark} "
                     f"ms; c = {c['c']:.4f}, v = [{v}]")
    for path, how in derived.items():
        lines.append(f"  * {path}: {how}")
    if table["derived_from_speedup"]:
        lines.append(f"  derived from the published speedup of {', '.join(table['derived_from_speedup'])}: "
                     "not a check of the model")
    if table.get("notes"):
        lines.append(f"  notes: {table['notes']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Observations: the published (acceptance, speedup) pairs


OBSERVATION_KEYS = {"id", "source", "model", "hardware", "engine", "batch", "k", "baseline_tok_s", "mtp_tok_s",
                    "acceptance", "mean_length", "table", "quote", "notes"}


def check_observations(data: Any, where: str, tables: list[str]) -> dict[str, Any]:
    """``data`` if it is an observations file: ``format`` ``glm-mtp-observations/1``,
    ``observations`` a list of objects (``id`` unique, ``source``/``model``/``hardware``/``engine``/
    ``quote`` non-empty strings, ``batch`` an int >= 1, ``k`` an int >= 1 or null,
    ``baseline_tok_s``/``mtp_tok_s`` numbers > 0 or null, ``acceptance`` null or k numbers in [0, 1]
    (P(accepted >= i), i = 1..k, non-increasing), ``mean_length`` null or a number in [1, k + 1]
    (not both), ``table`` a name in ``tables`` or null, ``notes`` optional) and ``not_found`` a list
    of {ref, queries, notes}. ``ValueError`` naming the entry and the rule."""
    if not isinstance(data, dict) or data.get("format") != OBSERVATIONS_FORMAT:
        raise ValueError(f"{where}: must be a JSON object with format {OBSERVATIONS_FORMAT!r}")
    obs = data.get("observations")
    if not isinstance(obs, list):
        raise ValueError(f"{where}: observations must be a list")
    seen = set()
    for i, o in enumerate(obs):
        at = f"{where}: observations[{i}]"
        if not isinstance(o, dict):
            raise ValueError(f"{at} must be an object")
        extra = sorted(set(o) - OBSERVATION_KEYS)
        if extra:
            raise ValueError(f"{at}.{extra[0]} is not a field")
        if not _text(o.get("id")) or o["id"] in seen:
            raise ValueError(f"{at}.id must be a non-empty string used once, got {o.get('id')!r}")
        seen.add(o["id"])
        for key in ("source", "model", "hardware", "engine", "quote"):
            if not _text(o.get(key)):
                raise ValueError(f"{at}.{key} must be a non-empty string")
        if isinstance(o.get("batch"), bool) or not isinstance(o.get("batch"), int) or o["batch"] < 1:
            raise ValueError(f"{at}.batch must be an int >= 1")
        k = o.get("k")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"{at}.k must be an int >= 1 or null")
        for key in ("baseline_tok_s", "mtp_tok_s"):
            if o.get(key) is not None and not _positive(o[key]):
                raise ValueError(f"{at}.{key} must be a number > 0 or null")
        acc, mean = o.get("acceptance"), o.get("mean_length")
        if acc is not None and mean is not None:
            raise ValueError(f"{at}: give acceptance or mean_length, not both")
        if acc is not None:
            if k is None or not isinstance(acc, list) or len(acc) != k or not all(
                    not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x <= 1 for x in acc) or any(
                    b > a for a, b in zip(acc, acc[1:])):
                raise ValueError(f"{at}.acceptance must list P(accepted >= i) for i = 1..k: k numbers in [0, 1], "
                                 "non-increasing")
        if mean is not None and (k is None or not _positive(mean) or not 1 <= mean <= k + 1):
            raise ValueError(f"{at}.mean_length must be a number in [1, k + 1] with k given")
        if o.get("table") is not None and o["table"] not in tables:
            raise ValueError(f"{at}.table must name a shipped table ({', '.join(tables)}) or be null, got "
                             f"{o['table']!r}")
        if "notes" in o and not isinstance(o["notes"], str):
            raise ValueError(f"{at}.notes must be a string")
    nf = data.get("not_found")
    if not isinstance(nf, list) or not all(isinstance(x, dict) and _text(x.get("ref")) and _text(x.get("notes"))
                                           and isinstance(x.get("queries"), list) for x in nf):
        raise ValueError(f"{where}: not_found must be a list of {{ref, queries, notes}}")
    return data


def shipped_observations() -> dict[str, Any]:
    """The shipped ``observations.json``, checked against the shipped tables' names."""
    path = TABLES_DIR / "observations.json"
    return check_observations(read_json(path), str(path), shipped_names())
