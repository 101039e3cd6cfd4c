"""The launch and byte tables of ``docs/performance.md``, printed as Markdown from today's counters.

    python -m glm_mtp.tools.step_tables                       # every table (CPU minutes: Triton's interpreter)
    python -m glm_mtp.tools.step_tables --tables fused,next   # some of them

(the CLI sets ``TRITON_INTERPRET=1`` itself, re-executing when it was not set.) Each cell is one
``counters.measure_draft_step`` of random weights (seed 0) with 64 context rows and
``max_seq_len`` 256, as the document states beside the tables:

- ``fused``: GLM-5's fused step (tiny and small, bf16 and fp32): launches, kernel bytes against
  the floor, and the eager reference's operators and bytes;
- ``next``: the glm5_next step that runs the indexer (sharing off), bf16, fp32 and fp8 weights,
  and whether it counts the same at another capacity;
- ``sharing``: with index sharing on (DESIGN.md §9), draft step 1 and a shared step, both
  families, bf16 and fp8 weights.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.registry import parse_dtype

from .counters import interpreting, measure_draft_step

CONTEXT = 64
MAX_SEQ_LEN = 256
# The other capacity a glm5_next step is counted at (capped by each preset's max_position_embeddings).
OTHER_CAPACITY = {"glm5next_tiny": 512, "glm5next_small": 1024}
TABLES = ("fused", "next", "sharing")

# (preset, dtype, weights, index_share, backend, max_seq_len) -> measure_draft_step's record
Key = tuple[str, str, str, bool, str, int]
Count = Callable[[Key], dict[str, Any]]


def count_step(key: Key) -> dict[str, Any]:
    """One draft step counted (``measure_draft_step``) for ``key``: preset, activation dtype,
    ``plain`` or ``fp8`` weights, index sharing, backend, max_seq_len."""
    preset, dtype, weights, share, backend, max_seq_len = key
    w = MtpWeights.random(MtpConfig.preset(preset), seed=0, dtype=parse_dtype(dtype), device="cpu")
    if weights == "fp8":
        w = w.quantize_fp8()
    return measure_draft_step(w.with_index_share(share), "triton", backend=backend, context=CONTEXT,
                              max_seq_len=max_seq_len, seed=0)


def cached(count: Count) -> Count:
    """``count`` that measures each key once (the tables share cells)."""
    seen: dict[Key, dict[str, Any]] = {}

    def once(key: Key) -> dict[str, Any]:
        if key not in seen:
            seen[key] = count(key)
        return seen[key]

    return once


def ratio_cell(kernel: int, floor: int, bold: bool = True) -> str:
    """``106,889 / 99,872 = **1.07x**``."""
    r = f"{kernel / floor:.2f}x"
    return f"{kernel:,} / {floor:,} = " + (f"**{r}**" if bold else r)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fused_table(count: Count) -> str:
    """GLM-5's fused step at tiny and small, bf16 and fp32, and the eager reference's."""
    cols = [(p, d) for p in ("tiny", "small") for d in ("bfloat16", "float32")]
    opt = [count((p, d, "plain", False, "optimized", MAX_SEQ_LEN)) for p, d in cols]
    ref = [count((p, d, "plain", False, "reference", MAX_SEQ_LEN)) for p, d in cols]
    return table(["per draft step", *[f"{p} {short(d)}" for p, d in cols]], [
        ["optimized, fused: launches", *[f"**{r['launches_per_draft']}** ({r['triton_launches_per_draft']} Triton)"
                                         for r in opt]],
        ["optimized, fused: kernel bytes / floor",
         *[ratio_cell(r["kernel_bytes_per_draft"], r["floor_bytes_per_draft"]) for r in opt]],
        ["reference (pinned, eager): operators, bytes / floor",
         *[f"{r['launches_per_draft']}, {r['kernel_floor_ratio']:.1f}x" for r in ref]],
    ])


def next_table(count: Count) -> str:
    """The glm5_next step that runs the indexer, at two capacities."""
    cols = [("glm5next_tiny", "bfloat16", "plain"), ("glm5next_tiny", "float32", "plain"),
            ("glm5next_small", "bfloat16", "plain"), ("glm5next_small", "float32", "plain"),
            ("glm5next_tiny", "bfloat16", "fp8"), ("glm5next_small", "bfloat16", "fp8")]
    here = [count((p, d, w, False, "optimized", MAX_SEQ_LEN)) for p, d, w in cols]
    there = [count((p, d, w, False, "optimized", OTHER_CAPACITY[p])) for p, d, w in cols]
    fields = ("launches_per_draft", "triton_launches_per_draft", "kernel_bytes_per_draft", "floor_bytes_per_draft")

    def same(a: dict[str, Any], b: dict[str, Any], p: str) -> str:
        if all(a[f] == b[f] for f in fields):
            return f"equal (M {MAX_SEQ_LEN}, {OTHER_CAPACITY[p]})"
        return f"M {OTHER_CAPACITY[p]}: {b['launches_per_draft']}, " + ratio_cell(
            b["kernel_bytes_per_draft"], b["floor_bytes_per_draft"], bold=False)

    names = [f"{p.removeprefix('glm5next_')} {short(d, w)}" for p, d, w in cols]
    return table(["per draft step (glm5_next)", *names], [
        ["launches (Triton)", *[f"**{r['launches_per_draft']}** ({r['triton_launches_per_draft']})" for r in here]],
        ["kernel bytes / floor", *[ratio_cell(r["kernel_bytes_per_draft"], r["floor_bytes_per_draft"]) for r in here]],
        ["the same at the other capacity", *[same(a, b, c[0]) for a, b, c in zip(here, there, cols)]],
    ])


def sharing_tables(count: Count) -> str:
    """Draft step 1 and a shared step with index sharing on, GLM-5 then glm5_next."""
    out = []
    for tiny, small in (("tiny", "small"), ("glm5next_tiny", "glm5next_small")):
        cols = [(tiny, "plain"), (tiny, "fp8"), (small, "plain"), (small, "fp8")]
        recs = [count((p, "bfloat16", w, True, "optimized", MAX_SEQ_LEN)) for p, w in cols]
        names = [f"{p} {short('bfloat16', w)}" for p, w in cols]
        out.append(table(["draft step, sharing on", *names], [
            ["step 1: launches", *[str(r["launches_step_1"]) for r in recs]],
            ["step 1: kernel bytes / floor",
             *[ratio_cell(r["kernel_bytes_step_1"], r["floor_bytes_step_1"], bold=False) for r in recs]],
            ["shared step: launches (Triton)",
             *[f"**{r['launches_per_draft']}** ({r['triton_launches_per_draft']})" for r in recs]],
            ["shared step: kernel bytes / floor",
             *[ratio_cell(r["kernel_bytes_per_draft"], r["floor_bytes_per_draft"]) for r in recs]],
            ["step 1 counts as without sharing", *["yes" if r["step_1_unchanged"] else "**no**" for r in recs]],
        ]))
    return "\n\n".join(out)


def short(dtype: str, weights: str = "plain") -> str:
    """``bf16``, ``fp32``, ``fp8`` (fp8 weights, bf16 activations)."""
    return "fp8" if weights == "fp8" else {"bfloat16": "bf16", "float32": "fp32"}[dtype]


BUILDERS = {"fused": fused_table, "next": next_table, "sharing": sharing_tables}


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m glm_mtp.tools.step_tables",
                                description="docs/performance.md's launch and byte tables, counted now, as Markdown.")
    p.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)} (default all)")
    a = p.parse_args(argv)
    chosen = [t for t in a.tables.split(",") if t]
    if not chosen or any(t not in TABLES for t in chosen):
        p.error(f"--tables must name some of {', '.join(TABLES)}, got {a.tables!r}")
    torch.set_num_threads(1)
    count = cached(count_step)
    tables = []
    for t in chosen:  # each table printed once counted: the counts take minutes in the interpreter
        tables.append(f"<!-- {t} -->\n" + BUILDERS[t](count))
        print(tables[-1] + "\n", flush=True)
    return "\n\n".join(tables)


if __name__ == "__main__":
    if not interpreting():
        # Triton was imported with the package, before this line: start again with the variable set.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "glm_mtp.tools.step_tables", *sys.argv[1:]])
    main()
