"""The speedup model's cost tables and their check against the field (DESIGN.md §15).

    python -m glm_mtp.experiments.costs list            # the shipped tables, observations, what was not found
    python -m glm_mtp.experiments.costs show NAME|PATH  # one table: ms per width, c, v(k), sources, derived numbers
    python -m glm_mtp.experiments.costs check           # published (acceptance, speedup) pairs against the model

``check`` prints, for every published pair whose costs were measured independently of its
speedup, the model's prediction beside the measured speedup and their ratio, and exits 1 when a
ratio leaves the band (``loop/cost_check.py`` states and justifies it) or no such pair exists;
pairs whose table was derived from a published speedup are printed apart, as no check. The
tables' format: ``loop/cost_tables.py`` and docs/costs.md. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from .loop import cost_check, cost_tables


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glm_mtp.experiments.costs", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the shipped cost tables, the published observations and the references not found")
    show = sub.add_parser("show", help="one table (a shipped name or a file's path)")
    show.add_argument("name")
    sub.add_parser("check", help="the model's prediction beside every published speedup")
    return p.parse_args(argv)


def load(name: str) -> dict:
    """A shipped table by name, else the table file at the path ``name``."""
    if name in cost_tables.shipped_names() or not os.path.exists(name):
        return cost_tables.shipped_table(name)
    return cost_tables.read_table(name)


def list_all() -> str:
    tables = [cost_tables.shipped_table(n) for n in cost_tables.shipped_names()]
    data = cost_tables.shipped_observations()
    lines = ["Cost tables (speedup.costs=NAME):"]
    lines += [f"- {cost_tables.label(t)}, batch {', '.join(str(b['batch']) for b in t['batches'])}, widths "
              f"1..{max(len(b['forward_ms']) for b in t['batches'])}; source: {t['source']}" for t in tables]
    lines += ["- bytes:glm5, bytes:glm5next (GLM-5's, GLM-5.3-Flash's from the bytes each step reads: the "
              "memory-bound limit, an upper bound on v)", "- measured (this run's own target and drafter, timed)",
              "", "Published observations:"]
    for o in data["observations"]:
        rates = (f"{o['baseline_tok_s']:g} -> {o['mtp_tok_s']:g} tok/s"
                 if o.get("baseline_tok_s") and o.get("mtp_tok_s") else "no rates")
        lines.append(f"- {o['id']} ({o['source']}): {o['model']} on {o['hardware']}, {o['engine']}, k = {o['k']}, "
                     f"{rates}; table {o['table']}: \"{o['quote']}\"")
    lines += ["", "Searched for and not found:"]
    lines += [f"- {x['ref']}: {x['notes']}" for x in data["not_found"]]
    return "\n".join(lines)


def check() -> tuple[str, bool]:
    tables = {n: cost_tables.shipped_table(n) for n in cost_tables.shipped_names()}
    rows, ok = cost_check.run_check(cost_tables.shipped_observations()["observations"], tables)
    text = cost_check.format_rows(rows)
    verdict = "check passed" if ok else "check FAILED: a ratio leaves the band, or no independent pair"
    return f"{text}\n\n{verdict}", ok


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        if a.command == "list":
            print(list_all())
            return 0
        if a.command == "show":
            print(cost_tables.format_table(load(a.name)))
            return 0
        text, ok = check()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
