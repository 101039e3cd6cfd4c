"""``python -m glm_mtp.experiments.traces check DIR`` reports what is wrong with a trace, field by
field (exit 0: valid; 1: problems, one line each); ``drafter-only SRC OUT`` writes the copy of a
checkpoint that a replay runs from (``drafter_only``)."""

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
    args = parser.parse_args(argv)
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
