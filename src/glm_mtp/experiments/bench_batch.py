"""Batched drafting: drafted tokens per second and kernel bytes per draft step against batch size.

    python -m glm_mtp.experiments.bench_batch                              # CPU, small, B = 1 2 4 8 16
    python -m glm_mtp.experiments.bench_batch --device cuda --repeats 30   # a GPU: graphs per bucket

For each batch size B it drafts ``--drafts`` tokens for B sequences at different lengths (state b
holds ``context + 3 b`` rows) two ways, alternating round by round so their ratio holds on a
noisy machine: one ``propose_batch`` over the B states, and B ``propose`` calls one after the
other (what an engine without batching does). Each record has the median seconds of both, the
drafted tokens per second of both and their ratio.

With ``--counters`` (on by default) each record also carries the launch counters of one batched
draft step, counted on CPU in a subprocess through Triton's interpreter (``python -m
glm_mtp.tools.counters --batch B``): ``launches_per_step`` and ``kernel_bytes_per_step``, the
distinct bytes each launch reads or writes (a weight read once for all B rows counts once). The
bytes grow with B only by what is per row (each sequence's attended rows and its routed experts:
the union of the experts the B rows choose, at most all of them).

Writes ``bench_batch.json``, ``bench_batch.md`` and ``bench_batch.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.ranges import SEED_MAX, ranged_int
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.registry import parse_dtype
from glm_mtp.tools.timing import BENCH_DTYPES, timed

from .reporting.kept import RecordLog, keeping, replaced, write_json, write_text
from .settings.entry import exit_on_late_failure
from .settings.validate import unwritable_dir


COUNTER_KEYS = ("launches_per_step", "triton_launches_per_step", "kernel_bytes_per_step", "kernel_bytes_per_row")


def batch_counters(a: argparse.Namespace, batches: list[int], progress: Any = None) -> dict[int, dict[str, Any]]:
    """``python -m glm_mtp.tools.counters --batch B`` for every B, in subprocesses (the
    interpreter needs ``TRITON_INTERPRET=1`` before triton is imported), one per core at a time,
    largest batch first (the longest)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    todo = sorted(batches, reverse=True)
    running: dict[int, subprocess.Popen] = {}
    out: dict[int, dict[str, Any]] = {}
    while todo or running:
        while todo and len(running) < max(1, os.cpu_count() or 1):
            b = todo.pop(0)
            argv = [sys.executable, "-m", "glm_mtp.tools.counters", "--preset", a.preset, "--dtype", a.dtype,
                    "--kernels",
                    "triton", "--context", str(a.context), "--max-seq-len", str(a.max_seq_len), "--seed", str(a.seed),
                    "--batch", str(b), "--json"]
            running[b] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        b = next(iter(running))
        stdout, stderr = running[b].communicate()
        if running.pop(b).returncode:
            for p in running.values():
                p.kill()
            raise RuntimeError(f"counters --batch {b} failed:\n{stderr[-4000:]}")
        result = json.loads(stdout.strip().splitlines()[-1])
        out[b] = {k: result[k] for k in COUNTER_KEYS}
        if progress is not None:
            progress.update(1)
    return out


def bench_batch(a: argparse.Namespace, weights: MtpWeights, batch: int, progress: Any) -> dict[str, Any]:
    """Median seconds of one ``propose_batch`` of ``a.drafts`` drafts over ``batch`` states and of
    ``batch`` single proposes, alternating, after ``a.warmup`` uncounted rounds."""
    device, cfg = weights.device, weights.config
    prop = OptimizedProposer(weights, a.max_seq_len, max_batch=max(a.batch_sizes))
    gen = torch.Generator(device).manual_seed(a.seed + batch)
    states = [prop.alloc_state(device) for _ in range(batch)]
    try:
        held = []
        for b, st in enumerate(states):
            n = a.context + 3 * b + 1
            prop.prefill_drafter(torch.randint(cfg.vocab_size, (n,), generator=gen, device=device),
                                 torch.randn(n, cfg.hidden_size, generator=gen, device=device).to(weights.dtype), st)
            held.append(prop.drafter_rows(st))
        tokens = torch.randint(cfg.vocab_size, (batch,), generator=gen, device=device).tolist()
        hidden = torch.randn(batch, cfg.hidden_size, generator=gen, device=device).to(weights.dtype)

        def batched() -> None:
            prop.propose_batch(tokens, hidden, held, a.drafts, states)

        def one_by_one() -> None:
            for b, st in enumerate(states):
                prop.propose(tokens[b], hidden[b], held[b], a.drafts, st)

        def verify() -> None:
            for st in states:
                prop.after_verify(0, st)  # keeps the first row; the next propose rewinds to the same place

        times: dict[str, list[float]] = {"batched": [], "sequential": []}
        for r in range(a.warmup + a.repeats):
            for name, fn in (("batched", batched), ("sequential", one_by_one)):
                t = timed(fn, device)
                verify()
                if r >= a.warmup:
                    times[name].append(t)
            progress.update(1)
    finally:
        for st in states:
            prop.free_state(st)
    tb, ts = statistics.median(times["batched"]), statistics.median(times["sequential"])
    drafted = batch * a.drafts
    return dict(
        preset=a.preset, dtype=a.dtype, device=str(device), batch=batch, num_drafts=a.drafts, context_rows=held,
        batched_s_median=tb, sequential_s_median=ts,
        batched_tokens_per_s=drafted / tb, sequential_tokens_per_s=drafted / ts, batched_over_sequential=ts / tb,
        batched_s=times["batched"], sequential_s=times["sequential"],
    )


def markdown_table(records: list[dict[str, Any]]) -> str:
    lines = ["| B | batched tok/s | one-by-one tok/s | batched / one-by-one | launches / step | kernel KiB / step | "
             "KiB / step / row |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        counted = "launches_per_step" in r
        lines.append(
            f"| {r['batch']} | {r['batched_tokens_per_s']:.0f} | {r['sequential_tokens_per_s']:.0f} | "
            f"{r['batched_over_sequential']:.2f}x | "
            + (f"{r['launches_per_step']} | {r['kernel_bytes_per_step'] / 1024:.1f} | "
               f"{r['kernel_bytes_per_row'] / 1024:.1f} |"
               if counted else "— | — | — |"))
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Bs = [r["batch"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    ax = axes[0]
    ax.plot(Bs, [r["batched_tokens_per_s"] for r in records], "o-", label="propose_batch")
    ax.plot(Bs, [r["sequential_tokens_per_s"] for r in records], "s--", label="one propose per state")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("drafted tokens / s")
    ax.set_title(f"{records[0]['preset']} ({records[0]['device']}, {records[0]['dtype']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    counted = [r for r in records if "kernel_bytes_per_step" in r]
    if counted:
        b1 = counted[0]["kernel_bytes_per_step"] / counted[0]["batch"]
        ax.plot([r["batch"] for r in counted], [r["kernel_bytes_per_step"] / 2**20 for r in counted], "o-",
                label="propose_batch")
        ax.plot([r["batch"] for r in counted], [b1 * r["batch"] / 2**20 for r in counted], "k--",
                label="B separate steps")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("kernel MiB per draft step")
        ax.set_title("bytes per step (interpreter counts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glm_mtp.experiments.bench_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--drafts", type=int, default=3, help="num_drafts of every propose")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES)
    p.add_argument("--context", type=int, default=32, help="rows state 0 holds; state b holds context + 3 b")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None, help="default: 7 on cpu, 30 on cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=ranged_int(0, SEED_MAX), default=0)
    p.add_argument("--no-counters", dest="counters", action="store_false", help="skip the interpreter's counts")
    p.add_argument("--out", default=None, help="default: outputs/bench_batch/<device>-<time>")
    a = p.parse_args(argv)
    try:
        MtpConfig.preset(a.preset)
    except ValueError as e:
        p.error(str(e))
    if any(b < 1 for b in a.batch_sizes) or a.drafts < 1 or a.context < 1 or a.warmup < 0:
        p.error("--batch-sizes and --drafts must be >= 1, --context >= 1, --warmup >= 0")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    rows = a.context + 3 * (max(a.batch_sizes) - 1) + a.drafts + 2
    if rows > a.max_seq_len:
        p.error("--max-seq-len must exceed --context + 3 (max batch - 1) + --drafts + 2 (the longest state's rows)")
    cap = MtpConfig.preset(a.preset).max_position_embeddings
    if rows > cap:  # the preset's context caps a drafter's max_seq_len
        p.error(f"--context {a.context}: the longest state holds {rows} rows, past preset {a.preset}'s context "
                f"(max_position_embeddings {cap}, which caps --max-seq-len)")
    a.repeats = a.repeats if a.repeats is not None else (30 if a.device.startswith("cuda") else 7)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    a.out = a.out or os.path.join("outputs", "bench_batch",
                                  f"{a.device.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}")
    if why := unwritable_dir(a.out):
        p.error(f"--out {why}")
    return a


PROG = "python -m glm_mtp.experiments.bench_batch"
# Each batch size's timings, appended to ``--out`` as it finishes (``reporting.kept``).
RECORDS_FILE = "records.jsonl"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    exit_on_late_failure(PROG, lambda: run(a))


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Time every batch size, count them (``--counters``), write the files into ``a.out``. Each
    batch size's timings are in ``records.jsonl`` as it finishes; a failure after the first
    (another batch, the counters, the files) is a ``LateFailure`` naming what was kept."""
    from tqdm import tqdm

    device = torch.device(a.device)
    weights = MtpWeights.random(MtpConfig.preset(a.preset), seed=a.seed, dtype=parse_dtype(a.dtype), device=device)
    records: list[dict[str, Any]] = []
    kept = RecordLog(os.path.join(a.out, RECORDS_FILE))
    with keeping("bench_batch", kept, "batch size(s)", also=[os.path.join(a.out, "bench_batch.json")]):
        with tqdm(total=len(a.batch_sizes) * (a.warmup + a.repeats), desc="bench_batch", unit="round") as progress:
            for B in a.batch_sizes:
                progress.set_postfix(batch=B)
                records.append(bench_batch(a, weights, B, progress))
                kept.append(records[-1])
        if a.counters:
            with tqdm(total=len(records), desc="counters (interpreter)", unit="batch") as progress:
                counted = batch_counters(a, [r["batch"] for r in records], progress)
            for r in records:
                r.update(counted[r["batch"]])
        write_files(a, records)
    return records


def write_files(a: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    """bench_batch.json (first), .md and .png into ``a.out``, each whole or not at all; the table printed."""
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
                cpu_count=os.cpu_count(), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                config={k: v for k, v in vars(a).items()})
    write_json(str(out / "bench_batch.json"), dict(meta=meta, records=records))
    write_text(str(out / "bench_batch.md"),
               f"Device: {meta['device']} ({a.device}, {a.dtype}); preset {a.preset}; {a.drafts} drafts per propose; "
               f"state b holds {a.context} + 3b rows; median of {a.repeats} alternating rounds.\n\n"
               + markdown_table(records))
    with replaced(str(out / "bench_batch.png")) as tmp:
        plot(records, Path(tmp))
    print(markdown_table(records))
    print(f"wrote {out}/bench_batch.json, bench_batch.md, bench_batch.png")


if __name__ == "__main__":
    main()
