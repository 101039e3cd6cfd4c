"""The speedup model checked against the field: published (acceptance, speedup) pairs beside the
model's prediction from that acceptance and a cost table of the same hardware and engine.

For an observation (``observations.json``, ``cost_tables.check_observations``) at k drafts a
round, the model predicts ``S(k) = tau / (1 + k c + v(k))`` with ``tau`` its mean accepted length
(``mean_length``, or 1 + the sum of its P(accepted >= i)) and ``c``, ``v(k)`` from its table at its
batch size (``cost_tables.costs_at``); the engine measured ``mtp_tok_s / baseline_tok_s``. The
ratio predicted / measured is a check of the model only when the table's numbers were measured
independently of that speedup; a table derived from a published speedup reproduces it by
construction and is listed apart (``derived``), its ratio shown for what it is.

The band: a ratio in ``BAND = [0.85, 1.20]`` passes. Above 1 the model is expected to sit: it prices
a round as its forwards only, and a real round also pays work the forwards' timings leave out
(reading the verdict, rolling back the caches, sampling k + 1 positions, the host's loop:
kekzl/imp#1055 measures ~1.3 ms of loop overhead between verifies beside a 7.8 ms verify, about
17%), so up to +20% is the model's known optimism, not a wrong cost table. Below 1 the model has no
such excuse: only the published figures' own spread can put it there (an acceptance over 135 cycles
has a binomial standard error of about 2.6 points, so tau is known to about ±3% at 1 draft; a draft
step published as "~6 ms" moves a round by ±1.5%; a median verify against a mean-rate baseline by a
few percent), about -10% at two standard errors, so the floor is 0.85. A ratio outside the band
means the model or the table is wrong for that engine.
"""

from __future__ import annotations

from typing import Any

from . import cost_tables

BAND = (0.85, 1.20)


def tau_of(obs: dict[str, Any]) -> float | None:
    """An observation's mean accepted length: ``mean_length``, or 1 + sum of P(accepted >= i)."""
    if obs.get("mean_length") is not None:
        return float(obs["mean_length"])
    if obs.get("acceptance") is not None:
        return 1.0 + float(sum(obs["acceptance"]))
    return None


def assess(obs: dict[str, Any], tables: dict[str, dict[str, Any]], band: tuple[float, float] = BAND) -> dict[str, Any]:
    """One observation's row: ``kind`` (``check``: an independent pair; ``derived``: its table came
    from a published speedup; ``unchecked``: something the prediction needs is not published,
    ``reason`` says what), ``predicted``, ``measured``, ``ratio`` and ``in_band`` where they exist."""
    row: dict[str, Any] = {"id": obs["id"], "source": obs["source"], "model": obs["model"],
                           "hardware": obs["hardware"], "engine": obs["engine"], "k": obs.get("k"),
                           "table": obs.get("table"), "tau": tau_of(obs)}
    missing = [name for name, ok in (("a cost table", obs.get("table") is not None), ("k", obs.get("k") is not None),
                                     ("the acceptance", row["tau"] is not None),
                                     ("both tok/s", obs.get("baseline_tok_s") and obs.get("mtp_tok_s"))) if not ok]
    if missing:
        return {**row, "kind": "unchecked", "reason": "not published: " + ", ".join(missing)}
    table = tables[obs["table"]]
    k = int(obs["k"])
    costs = cost_tables.costs_at(table, k, obs["batch"])
    predicted = row["tau"] / (1.0 + k * costs["c"] + costs["v"][k - 1])
    measured = obs["mtp_tok_s"] / obs["baseline_tok_s"]
    ratio = predicted / measured
    kind = "derived" if table["derived_from_speedup"] else "check"
    return {**row, "kind": kind, "c": costs["c"], "v_k": costs["v"][k - 1], "extrapolated": k in costs["extrapolated"],
            "predicted": predicted, "measured": measured, "ratio": ratio,
            "in_band": band[0] <= ratio <= band[1]}


def run_check(observations: list[dict[str, Any]], tables: dict[str, dict[str, Any]],
              band: tuple[float, float] = BAND) -> tuple[list[dict[str, Any]], bool]:
    """Every observation's row (``assess``) and whether the check passes: at least one independent
    pair, and every independent pair's ratio in ``band``."""
    rows = [assess(o, tables, band) for o in observations]
    checks = [r for r in rows if r["kind"] == "check"]
    return rows, bool(checks) and all(r["in_band"] for r in checks)


def format_rows(rows: list[dict[str, Any]], band: tuple[float, float] = BAND) -> str:
    """The check as Markdown: the independent pairs, then the derived ones, then the unchecked."""
    head = ("| observation | model, hardware, engine | k | τ | table | c | v(k) | predicted S | measured S | "
            "ratio | in band |\n|---|---|---|---|---|---|---|---|---|---|---|")

    def line(r: dict[str, Any]) -> str:
        extra = " (v extrapolated)" if r["extrapolated"] else ""
        return (f"| {r['id']} ({r['source']}) | {r['model']}, {r['hardware']}, {r['engine']} | {r['k']} | "
                f"{r['tau']:.3f} | {r['table']}{extra} | {r['c']:.4f} | {r['v_k']:.3f} | {r['predicted']:.3f} | "
                f"{r['measured']:.3f} | {r['ratio']:.3f} | {'yes' if r['in_band'] else 'NO'} |")

    out = [f"Independent pairs (costs measured apart from the speedup): band [{band[0]:.2f}, {band[1]:.2f}]", head]
    out += [line(r) for r in rows if r["kind"] == "check"] or ["| (none) |"]
    derived = [r for r in rows if r["kind"] == "derived"]
    if derived:
        out += ["", "Derived from a published speedup (the table reproduces it by construction: not a check)", head]
        out += [line(r) for r in derived]
    unchecked = [r for r in rows if r["kind"] == "unchecked"]
    if unchecked:
        out += ["", "Not checkable"]
        out += [f"- {r['id']} ({r['source']}; {r['model']}, {r['hardware']}, {r['engine']}): {r['reason']}"
                for r in unchecked]
    return "\n".join(out)
