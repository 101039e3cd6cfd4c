"""``python -m glm_mtp.experiments.traces check DIR`` reports what is wrong with a trace, field by
field (exit 0: valid; 1: problems, one line each); ``drafter-only SRC OUT`` writes the copy of a
checkpoint that a replay runs from (``drafter_only``); ``grid-report SWEEP`` tabulates an
``experiment=trace_grid`` sweep with its target forwards, recorded against live (``grid_report``)."""

from __future__ import annotations

import argparse
import os
import sys

from .validate import problems, read_meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm_mtp.experiments.traces")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check a trace directory, field by field")
    check.add_argument("directory")
    cut = sub.add_parser("drafter-only", help="copy a checkpoint's MTP layer, embedding and head (no target layer)")
    cut.add_argument("src")
    cut.add_argument("out")
    grid = sub.add_parser("grid-report", help="the table and target forwards of an experiment=trace_grid sweep")
    grid.add_argument("sweep_dir")
    grid.add_argument("--out", help="also write the table (Markdown) to this file")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # an argument or an input file refused before any write: one line, exit 2
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """One command; ``ValueError`` for an argument refused (nothing written)."""
    if args.command == "grid-report":
        from .grid_report import check_report_out, format_grid, format_pivot, read_grid

        check_report_out(args.out, args.sweep_dir)
        rows = read_grid(args.sweep_dir)
        text = format_pivot(rows) + "\n\n" + format_grid(rows)
        print(text)
        if args.out:
            with open(args.out, "x") as f:  # exclusive: a file made since the check is not overwritten
                f.write(text + "\n")
        return 0
    if args.command == "check":
        if not os.path.isdir(args.directory) or not os.access(args.directory, os.R_OK | os.X_OK):
            raise ValueError(f"directory: {args.directory} is not a readable folder")
        found = problems(args.directory)
        for line in found:
            print(line)
        if found:
            print(f"{args.directory}: {len(found)} problem(s)", file=sys.stderr)
            return 1
        meta = read_meta(args.directory)
        print(f"{args.directory}: a valid trace (version {meta['version']}, mode {meta['mode']}, {len(meta['items'])} "
              f"items, max_drafts {meta['max_drafts']}, hidden {meta['hidden_dtype']} x {meta['hidden_size']})")
        return 0
    from .drafter_only import write_drafter_only

    names = write_drafter_only(args.src, args.out)
    print(f"wrote {len(names)} tensors (the MTP layer, embedding, head) into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
