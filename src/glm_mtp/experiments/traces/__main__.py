"""``python -m glm_mtp.experiments.traces check DIR`` reports what is wrong with a trace, field by
field (exit 0: valid; 1: problems, one line each); ``drafter-only SRC OUT`` writes the copy of a
checkpoint that a replay runs from (``drafter_only``); ``grid-report SWEEP`` tabulates an
``experiment=trace_grid`` sweep with its target forwards, recorded against live (``grid_report``)."""

from __future__ import annotations

import argparse
import sys

from .format import problems, read_meta


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
    if args.command == "grid-report":
        from .grid_report import format_grid, format_pivot, read_grid

        try:
            rows = read_grid(args.sweep_dir)
            text = format_pivot(rows) + "\n\n" + format_grid(rows)
        except ValueError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 2
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return 0
    if args.command == "check":
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
