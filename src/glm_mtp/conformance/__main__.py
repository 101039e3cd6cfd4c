"""``python -m glm_mtp.conformance``: run the lockstep suite from the command line.

    python -m glm_mtp.conformance --candidate optimized --baseline reference \\
        --device cpu --dtype bfloat16 --preset tiny --scenarios 200 --seed 0

Prints a summary table and writes a JSON report (``--json PATH``; by default
``outputs/conformance/<time>/conformance-report.json`` under the current folder, as the Hydra
entry points write ``outputs/<task>/<time>/``), then the report's path. Exit status, one meaning each: 0 when every
step is equal byte for byte, 1 on a difference (and only then), 2 when nothing could be compared:
bad arguments (an unknown backend, preset or dtype, a device that is not there, a backend that
cannot be imported, a ``--max-drafts`` the generators cannot serve, a scenario file that is not
one, a ``--json`` path that cannot be written) or any other error, printed as one line.
``--scenario-index I`` replays one scenario, as the failure report's replay line does.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from glm_mtp.ranges import SEED_MAX, THREADS_MAX, ranged_int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glm_mtp.conformance",
                                description="Lockstep conformance of two drafter backends, byte for byte.")
    p.add_argument("--candidate", default="optimized",
                   help="reference | optimized | mutant:<name> | package.module:factory (default optimized)")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"),
                   help="the optimized backend's kernels: auto (Triton on CUDA, the torch twins on CPU), triton "
                        "(everywhere; the interpreter on CPU) or torch (default auto)")
    p.add_argument("--baseline", default="reference", help="the backend the candidate must equal (default reference)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 | float16 | float64 (default bfloat16)")
    p.add_argument("--preset", default="tiny",
                   help="MtpConfig preset: tiny | small | glm5_shape | glm5, or of the glm5_next family "
                        "glm5next_tiny | glm5next_small | glm5next (default tiny)")
    p.add_argument("--max-seq-len", type=ranged_int(1), default=64, help="the proposers' max_seq_len (default 64)")
    p.add_argument("--scenarios", type=ranged_int(1), default=100, help="scenarios to run (default 100)")
    p.add_argument("--seed", type=ranged_int(0, SEED_MAX), default=0,
                   help="the run's seed; scenario i depends only on (seed, i)")
    p.add_argument("--scenario-index", type=ranged_int(0), default=None, help="replay this scenario alone")
    p.add_argument("--scenario-file", default=None,
                   help="replay the scenario saved in this JSON file (the hypothesis machine writes one)")
    p.add_argument("--weights-seed", type=ranged_int(0, SEED_MAX), default=0,
                   help="seed of the random weights (default 0)")
    p.add_argument("--generators", default="realistic,adversarial",
                   help="comma-separated generators that take turns: realistic, adversarial, batched (default "
                        "realistic,adversarial)")
    p.add_argument("--max-drafts", type=ranged_int(1), default=4,
                   help="largest num_drafts of a valid propose (default 4)")
    p.add_argument("--grammars", default="auto", choices=("auto", "on", "off"),
                   help="draw grammars and sampled proposes and compare confidences (DESIGN.md §10, §12): auto (when "
                        "both backends take them), on (required), off (default auto)")
    p.add_argument("--json", default=None,
                   help="where to write the JSON report ('' for nowhere; default "
                        "outputs/conformance/<time>/conformance-report.json)")
    p.add_argument("--threads", type=ranged_int(0, THREADS_MAX), default=1,
                   help="torch CPU threads (default 1: tiny shapes gain nothing from more, and an oversubscribed "
                        "machine stalls OpenMP; 0 leaves torch's default)")
    p.add_argument("--list-mutants", action="store_true", help="list the mutants and the rule each breaks, then exit")
    return p.parse_args(argv)


DTYPE_NAMES = ("bfloat16", "float32", "float16", "float64")


def settings_error(args: argparse.Namespace) -> str | None:
    """Why a setting the run reads later is bad (checked before any weights are built), or ``None``."""
    if args.scenario_index is not None and args.scenario_index >= args.scenarios:
        return f"--scenario-index must be < --scenarios ({args.scenarios}), got {args.scenario_index}"
    if args.dtype not in DTYPE_NAMES:
        return f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {args.dtype!r}"
    if args.scenario_file is not None and not os.path.isfile(args.scenario_file):
        return f"--scenario-file {args.scenario_file} is not a file"
    if args.device.startswith("cpu"):  # before anything imports triton (main says why)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from glm_mtp.reference.config import MtpConfig

    try:
        config = MtpConfig.preset(args.preset)
    except ValueError as e:
        return f"--preset: {e}"
    return scenario_settings_error(args, config)


def scenario_settings_error(args: argparse.Namespace, config: Any) -> str | None:
    """The scenario generators' rules (``scenarios.scenario`` checks the same), by flag name:
    known generators, ``--max-seq-len`` at least their shortest prompt, ``--max-drafts`` within
    the rows a state has left after a prompt of ``--max-seq-len`` tokens; then the device."""
    from .scenarios import ALL_GENERATORS, MIN_MAX_SEQ_LEN, max_drafts_limit

    for g in (g for g in args.generators.split(",") if g):
        if g not in ALL_GENERATORS:
            return f"--generators: unknown generator {g!r}; known: {', '.join(ALL_GENERATORS)}"
    if args.max_seq_len < MIN_MAX_SEQ_LEN:
        return (f"--max-seq-len must be >= {MIN_MAX_SEQ_LEN} (the generators' prompts hold 2 or more tokens), "
                f"got {args.max_seq_len}")
    limit = max_drafts_limit(config, args.max_seq_len)
    if args.max_drafts > limit:
        return (f"--max-drafts must be <= {limit} (the rows a state has left after a prompt of --max-seq-len "
                f"{args.max_seq_len} tokens), got {args.max_drafts}")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        return f"--device {args.device!r} is not a device ({e})"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {args.device}, but CUDA is not available"
    if device.type not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda[:N], got {args.device!r}"
    return None


def unwritable(path: str) -> str | None:
    """Why a report could not be written at ``path`` (checked before the run), or ``None``."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--json {path} is a directory"
    if not os.path.isdir(folder):
        return f"--json {path}: the directory {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"--json {path} is not writable"
    return None


def default_report_path(now: float | None = None) -> str:
    """The report's path without ``--json``: ``outputs/conformance/<time>/conformance-report.json``,
    the time as the Hydra entry points name their run folders (``%Y-%m-%d_%H-%M-%S``)."""
    import time

    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))
    return os.path.join("outputs", "conformance", stamp, "conformance-report.json")


def with_kernels(backend: str, kernels: str) -> str:
    """``optimized`` with its kernel choice as an importable factory (so the replay command
    names it too); any other backend as it is."""
    if backend != "optimized" or kernels == "auto":
        return backend
    return f"glm_mtp.optimized.proposer:with_{'triton_kernels' if kernels == 'triton' else 'torch_twins'}"


def error(message: str) -> int:
    print(f"python -m glm_mtp.conformance: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := settings_error(args)) or (args.json and (why := unwritable(args.json))):
        return error(why)
    if args.device.startswith("cpu"):
        # Triton kernels run in its interpreter on the CPU; the variable must be set before
        # triton is imported (by the optimized backend).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    import torch

    from .mutants import MUTANTS
    from .runner import run

    if args.list_mutants:
        for name, cls in MUTANTS.items():
            print(f"mutant:{name:24s} {cls.rule}")
        return 0
    torch.use_deterministic_algorithms(True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    candidate, baseline = (with_kernels(b, args.kernels) for b in (args.candidate, args.baseline))
    try:
        report = run(
            candidate, baseline, scenarios=args.scenarios, seed=args.seed, device=args.device,
            dtype=args.dtype, preset=args.preset, max_seq_len=args.max_seq_len, scenario_index=args.scenario_index,
            generators=[g for g in args.generators.split(",") if g], weights_seed=args.weights_seed,
            max_drafts=args.max_drafts, scenario_file=args.scenario_file,
            grammars={"auto": None, "on": True, "off": False}[args.grammars],
        )
    except (OSError, ValueError) as e:  # bad names or files, an unavailable device, a backend that does not import
        return error(str(e))
    except Exception as e:  # a crash is not a difference: exit 1 must mean one
        return error(f"the run failed ({type(e).__name__}: {e})")
    print(report.summary())
    if args.json is None:  # the default folder is made only now: a refused or failed run writes nothing
        args.json = default_report_path()
        try:
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        except OSError as e:
            return error(f"the report's folder could not be made ({e})")
    if args.json:
        try:
            report.write_json(args.json)
        except OSError as e:
            return error(f"the report could not be written ({e})")
        print(f"report: {args.json}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
