"""Split the OOD source's files in two halves for the domain-adaptation measurement (RESULTS.md,
"Fine-tuning the MTP head from a trace"; issue #51 item 8 (b)).

    python results/finetune/domain/split_ood.py DIR

The OOD source (``source=ood``) is every ``.py`` file of the installed hydra and omegaconf
packages (``training.corpus.ood_items``, sorted). Its files alternate between the halves
(even index: ``DIR/tune``, odd: ``DIR/judge``), so both halves hold files of both packages and
no file is on both sides. Each file is copied under a name led by its index in the OOD order, so
``source=text prompts.path=DIR/tune`` (files read in sorted order, joined by blank lines) reads
the half in the same order ``source=ood`` reads the whole. Prints ``half index name`` a line.
DIR must be new or empty; nothing is written otherwise.
"""

from __future__ import annotations

import os
import shutil
import sys

from glm_mtp.experiments.training.corpus import ood_items, site_root


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: split_ood.py DIR (a new or empty folder)")
        return 2
    out = argv[0]
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        print(f"DIR: {out!r} exists and is not an empty folder")
        return 2
    root = site_root()
    for i, name in enumerate(ood_items()):
        half = "tune" if i % 2 == 0 else "judge"
        rel = name[len("site:"):]
        os.makedirs(os.path.join(out, half), exist_ok=True)
        shutil.copyfile(os.path.join(root, rel), os.path.join(out, half, f"{i:03d}_{rel.replace(os.sep, '__')}"))
        print(half, i, rel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
