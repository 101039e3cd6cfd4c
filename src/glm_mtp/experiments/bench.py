"""Propose latency and memory, reference vs optimized, against the memory-bandwidth floor.

    python -m glm_mtp.experiments.bench                       # CPU: tiny, small, glm5_shape; k = 1..5
    python -m glm_mtp.experiments.bench --device cuda --presets tiny small glm5_shape glm5
    python -m glm_mtp.experiments.bench --presets glm5next_tiny glm5next_small   # GLM-5.3-Flash's layer, + its H200
    projection python -m glm_mtp.experiments.bench --presets small --backends reference --max-position-embeddings 131072
    --max-seq-len 131072 python -m glm_mtp.experiments.bench --target-costs          # c and v(k) of the speedup model,
    toy target + GLM-5

For each backend, preset and k it measures the propose latency per draft token (median and
spread over repeated runs after warm-up; CUDA events on a GPU), the catch-up latency of one row,
host synchronisations and dispatched operators per propose, the memory one state holds, and the
bytes one draft step must read (the active weights, the head, the rows attended). The floor is
those bytes over the device's copy bandwidth, measured in the same run. Backends are timed
alternately, round by round, so their ratio holds on a noisy machine.

At the presets of ``--counters`` (default on CPU: those of ``COUNTER_PRESETS`` run; on CUDA none) each record also
carries the launch counters of one draft step, measured on CPU in a subprocess (``python -m
glm_mtp.tools.counters``, Triton's interpreter for the optimized backend's kernels):
``launches_per_draft`` (kernel launches plus the torch operators that would launch one on a GPU),
``kernel_bytes_per_draft`` (the bytes they load and store), ``floor_bytes_per_draft`` (the
weights a draft step must read plus its attended rows) and ``kernel_floor_ratio``. They do not
depend on k (the marginal draft step of a propose) nor on ``--device``. The reference backend is
counted the same way (its torch operators).

From the optimized backend's counts at each family's widest counted preset the bench projects
that family's full-width draft step on an H200 (``glm5``, ``glm5next``; ``tools.floor.project_step``:
the floor there times the counted ratio at the HBM bandwidth, plus the launches; a model). A family
that shares the indexer's selection (DESIGN.md §9: glm5next) gets two rows, draft step 1 and a
shared step (without the query side's weights and key reads).

Writes ``bench.json`` (one record per measurement, and ``projection``), ``bench.md`` and
``bench.png`` into ``--out``.

``--target-costs`` measures instead the costs of the speedup model (``speedup.py``) for the
experiments' toy target (the shipped checkpoint, or ``--checkpoint DIR``) on this machine: a
target decode step, a verify of k + 1 tokens and a draft step of each backend, medians of
alternating repeats; ``c`` = draft step / target step, ``v(k)`` = verify / target step - 1. It
also states GLM-5's from the bytes each step reads. Writes ``costs.json`` and ``costs.md``.
Needs only torch (+ triton for the optimized backend): no Hydra, no W&B, so it runs on a bare GPU
machine (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from glm_mtp.ranges import SEED_MAX, ranged_int
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.registry import BACKENDS, backend_class, parse_dtype
from glm_mtp.tools.counters import LaunchCounter
from glm_mtp.tools.floor import H200_BYTES_PER_S, GRAPH_LAUNCH_S, floor_bytes_per_draft, project_step
from glm_mtp.tools.timing import BENCH_DTYPES, copy_bandwidth, state_nbytes, timed

from .reporting.kept import RecordLog, keeping, late_failure, replaced, write_json, write_text
from .settings.entry import exit_on_late_failure
from .settings.validate import unwritable_dir

# Presets whose draft step the launch counters measure by default (the interpreter is slow).
COUNTER_PRESETS = ("tiny", "small", "glm5next_tiny", "glm5next_small")
# The counter fields each record gains (None where a preset was not counted).
COUNTER_FIELDS = ("launches_per_draft", "triton_launches_per_draft", "kernel_bytes_per_draft", "floor_bytes_per_draft",
                  "kernel_floor_ratio", "launches_per_propose_overhead", "kernel_bytes_per_propose_overhead",
                  # index sharing (DESIGN.md §9): the counted step is then a shared one, and step 1 is apart
                  "shared_step", "launches_step_1", "kernel_bytes_step_1", "floor_bytes_step_1",
                  "kernel_floor_ratio_step_1")


def backend_factory(name: str) -> Callable[[MtpWeights, int], Any]:
    """The proposer class of backend ``name`` (a key of ``glm_mtp.registry.BACKENDS``)."""
    return backend_class(name)


@dataclasses.dataclass
class BenchConfig:
    """What to measure.

    Args:
        presets: MtpConfig presets (``glm5`` needs a GPU's memory).
        backends: ``reference`` and/or ``optimized``.
        drafts: the k values.
        device / dtype: where and in what the drafter runs.
        context: rows held before each propose (the drafts attend to them).
        max_seq_len: the states' capacity (rounded up to blocks); a proposer caps it at the
            preset's ``max_position_embeddings`` (4096 for ``small``).
        max_position_embeddings: replaces the preset's value when set, so a capacity past the
            preset's cap can be measured (the cost of a draft step against ``max_seq_len``).
        repeats / warmup: timed proposes per (backend, k), after warm-up ones.
        copy_mib: size of the buffer the copy bandwidth is measured with.
        seed: weights and inputs.
        out: output folder.
        counters: presets whose draft step the launch counters measure (a CPU subprocess each;
            none unless named: the command line defaults to ``COUNTER_PRESETS``).
    """

    presets: list[str]
    backends: list[str]
    drafts: list[int]
    device: str = "cpu"
    dtype: str = "bfloat16"
    context: int = 64
    max_seq_len: int = 256
    max_position_embeddings: int | None = None
    repeats: int = 7
    warmup: int = 2
    copy_mib: int = 256
    seed: int = 0
    out: str = "outputs/bench"
    target_costs: bool = False
    checkpoint: str | None = None
    counters: list[str] = dataclasses.field(default_factory=list)


def draft_step_counters(bc: BenchConfig, preset: str, backend: str) -> dict[str, Any]:
    """The launch counters of one draft step of ``backend`` at ``preset`` (see
    ``glm_mtp.tools.counters``), measured on CPU in a subprocess with ``TRITON_INTERPRET=1``
    (the optimized backend forces its Triton kernels there), at this bench's dtype, context,
    capacity and seed. Returns the counter fields of ``COUNTER_FIELDS``."""
    argv = [sys.executable, "-m", "glm_mtp.tools.counters", "--preset", preset, "--dtype", bc.dtype, "--backend",
            backend,
            "--kernels", "triton", "--context", str(bc.context), "--max-seq-len", str(bc.max_seq_len), "--seed",
            str(bc.seed), "--json"]
    if bc.max_position_embeddings is not None:
        argv += ["--max-position-embeddings", str(bc.max_position_embeddings)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: result.get(k) for k in COUNTER_FIELDS}  # the *_step_1 fields: with sharing only


def bench_preset(bc: BenchConfig, preset: str, bandwidth: float, progress: Any) -> list[dict[str, Any]]:
    device, dtype = torch.device(bc.device), parse_dtype(bc.dtype)
    cfg = MtpConfig.preset(preset)
    if bc.max_position_embeddings is not None:
        cfg = cfg.replace(max_position_embeddings=bc.max_position_embeddings)
    weights = MtpWeights.random(cfg, seed=bc.seed, dtype=dtype, device=device)
    gen = torch.Generator(device).manual_seed(bc.seed + 1)
    P = bc.context
    prompt = torch.randint(cfg.vocab_size, (P + 1,), generator=gen, device=device)
    hiddens = torch.randn(P + 1, cfg.hidden_size, generator=gen, device=device).to(dtype)
    token, hidden = int(prompt[-1]), hiddens[-1]

    props, states, mem = {}, {}, {}
    for name in bc.backends:
        props[name] = backend_factory(name)(weights, bc.max_seq_len)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        states[name] = props[name].alloc_state(device)
        mem[name] = ((torch.cuda.memory_allocated(device) - before) if device.type == "cuda"
                     else state_nbytes(states[name]))
        props[name].prefill_drafter(prompt, hiddens, states[name])  # rows [0, P)

    def propose(name: str, k: int) -> Callable[[], Any]:
        return lambda: props[name].propose(token, hidden, P, k, states[name])

    counts = {name: draft_step_counters(bc, preset, name) if preset in bc.counters else dict.fromkeys(COUNTER_FIELDS)
              for name in bc.backends}
    records = []
    for k in bc.drafts:
        times: dict[str, list[float]] = {n: [] for n in bc.backends}
        for name in bc.backends:
            for _ in range(bc.warmup):
                propose(name, k)()
                props[name].after_verify(k, states[name])
        for r in range(bc.repeats):
            order = bc.backends if r % 2 == 0 else bc.backends[::-1]
            for name in order:
                times[name].append(timed(propose(name, k), device))
                props[name].after_verify(k, states[name])
            progress.update(1)
        for name in bc.backends:
            prop, state = props[name], states[name]
            counter = LaunchCounter(triton=False, measure_bytes=False)
            with counter:
                propose(name, k)()
            prop.after_verify(0, state)  # rows [0, P] held: the catch-up below appends row P + 1
            catch = []
            for _ in range(max(3, bc.repeats // 2)):
                catch.append(timed(functools.partial(prop.catchup_drafter, [token], hidden[None], P + 1, P + 1, state),
                                   device))
                prop.propose(token, hidden, P + 1, 0, state)  # rewind to P + 1
                prop.after_verify(0, state)
            per_draft = sorted(t / k for t in times[name])
            median = statistics.median(per_draft)
            step_bytes = floor_bytes_per_draft(cfg, dtype, P + (k + 1) // 2)
            floor = step_bytes / bandwidth
            records.append(
                dict(
                    backend=name, preset=preset, device=str(device), dtype=bc.dtype, num_drafts=k,
                    context_rows=P, max_seq_len=prop.max_seq_len,  # the capacity in effect, after the cap
                    latency_per_draft_ms_median=median * 1e3,
                    latency_per_draft_ms_p25=per_draft[len(per_draft) // 4] * 1e3,
                    latency_per_draft_ms_p75=per_draft[(3 * len(per_draft)) // 4] * 1e3,
                    propose_ms_median=statistics.median(times[name]) * 1e3,
                    catchup_row_ms_median=statistics.median(catch) * 1e3,
                    host_syncs_per_propose=counter.syncs,
                    ops_per_propose=counter.dispatched,
                    state_bytes=mem[name],
                    bytes_per_draft_step=step_bytes,
                    floor_ms_per_draft=floor * 1e3,
                    floor_ratio=median / floor,
                    repeats=bc.repeats,
                    **counts[name],
                )
            )
        if "reference" in times:
            ref = statistics.median(times["reference"])
            for rec in records[-len(bc.backends):]:
                rec["speedup_vs_reference"] = ref / statistics.median(times[rec["backend"]])
    for name in bc.backends:
        props[name].free_state(states[name])
    return records


def markdown_table(records: list[dict[str, Any]]) -> str:
    head = ("| preset | backend | k | ms/draft (median) | p25-p75 | speedup vs ref | floor ms/draft | x floor | syncs "
            "| ops | catch-up ms | state MiB | launches/draft | kernel KiB/draft | floor KiB/draft | "
            "kernel/floor bytes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def counter(r: dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
        return "-" if r.get(key) is None else fmt(r[key])

    for r in records:
        lines.append(
            f"| {r['preset']} | {r['backend']} | {r['num_drafts']} | {r['latency_per_draft_ms_median']:.3f} | "
            f"{r['latency_per_draft_ms_p25']:.3f}-{r['latency_per_draft_ms_p75']:.3f} | "
            f"{r.get('speedup_vs_reference', float('nan')):.2f} | {r['floor_ms_per_draft']:.4f} | "
            f"{r['floor_ratio']:.1f} | {r['host_syncs_per_propose']} | {r['ops_per_propose']} | "
            f"{r['catchup_row_ms_median']:.3f} | {r['state_bytes'] / 2**20:.2f} | "
            f"{counter(r, 'launches_per_draft', str)} | "
            f"{counter(r, 'kernel_bytes_per_draft', lambda b: f'{b / 1024:.1f}')} | "
            f"{counter(r, 'floor_bytes_per_draft', lambda b: f'{b / 1024:.1f}')} | "
            f"{counter(r, 'kernel_floor_ratio', lambda x: f'{x:.2f}')} |"
        )
    return "\n".join(lines) + "\n"


def projections(records: list[dict[str, Any]], dtype: torch.dtype) -> list[dict[str, Any]]:
    """The H200 projection of each family's full-width step (``tools.floor.project_step``: a
    model, not a measurement), from the optimized backend's counts at the widest preset of that
    family this run counted (``small`` over ``tiny``)."""
    counted = {r["preset"]: r for r in records if r["backend"] == "optimized" and r["kernel_floor_ratio"] is not None}
    widest: dict[str, dict[str, Any]] = {}
    for preset, r in counted.items():
        family = MtpConfig.preset(preset).family
        if family not in widest or r["floor_bytes_per_draft"] > widest[family]["floor_bytes_per_draft"]:
            widest[family] = r
    out = []
    for r in widest.values():
        steps = [(r["kernel_floor_ratio"], r["launches_per_draft"], False)]
        if r.get("shared_step"):  # sharing (DESIGN.md §9): step 1 first, then the shared steps
            steps = [(r["kernel_floor_ratio_step_1"], r["launches_step_1"], False), (*steps[0][:2], True)]
        for ratio, launches, shared in steps:
            p = project_step(r["preset"], ratio, launches, dtype, shared=shared)
            step = "shared" if shared else ("1" if r.get("shared_step") else "every")
            out.append(dict(preset=p.preset, counted_at=p.counted_at, step=step, visible_rows=p.visible_rows,
                            floor_bytes=p.floor_bytes, kernel_floor_ratio=p.kernel_floor_ratio, launches=p.launches,
                            step_bytes=p.step_bytes, step_ms=p.step_ms))
    return out


def projection_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"H200 projection (a model, not a measurement: bytes at {H200_BYTES_PER_S / 1e12:.1f} TB/s plus "
             f"{GRAPH_LAUNCH_S * 1e6:.1f} us a launch in a CUDA graph; the ratio and launches counted at a smaller "
             "preset of the family):",
             "",
             "| preset | counted at | draft step | visible rows | floor GB | x floor | launches | projected ms/draft |",
             "|---|---|---|---|---|---|---|---|"]
    for p in rows:
        lines.append(f"| {p['preset']} | {p['counted_at']} | {p['step']} | {p['visible_rows']} | "
                     f"{p['floor_bytes'] / 1e9:.3f} | {p['kernel_floor_ratio']:.2f} | {p['launches']} | "
                     f"{p['step_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in records))
    fig, axes = plt.subplots(1, len(presets), figsize=(4.5 * len(presets), 3.6), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        rows = [r for r in records if r["preset"] == preset]
        for backend in dict.fromkeys(r["backend"] for r in rows):
            rs = [r for r in rows if r["backend"] == backend]
            ks = [r["num_drafts"] for r in rs]
            ax.errorbar(
                ks, [r["latency_per_draft_ms_median"] for r in rs],
                yerr=[[r["latency_per_draft_ms_median"] - r["latency_per_draft_ms_p25"] for r in rs],
                      [r["latency_per_draft_ms_p75"] - r["latency_per_draft_ms_median"] for r in rs]],
                marker="o", capsize=3, label=backend,
            )
        floor = [r for r in rows if r["backend"] == rows[0]["backend"]]
        ax.plot([r["num_drafts"] for r in floor], [r["floor_ms_per_draft"] for r in floor], "k--",
                label="bandwidth floor")
        ax.set_yscale("log")
        ax.set_title(f"{preset} ({rows[0]['device']}, {rows[0]['dtype']})")
        ax.set_xlabel("drafts per propose (k)")
        ax.set_ylabel("ms per draft token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Each measured record, appended to ``--out`` as its preset finishes (``reporting.kept``).
RECORDS_FILE = "records.jsonl"


def run(bc: BenchConfig) -> list[dict[str, Any]]:
    """Measure every preset, then write bench.json, bench.md and bench.png into ``bc.out``. Each
    preset's records are in ``records.jsonl`` as it finishes; a failure after the first is a
    ``LateFailure`` naming what was kept (``reporting.kept``)."""
    from tqdm import tqdm

    device = torch.device(bc.device)
    torch.manual_seed(bc.seed)
    bandwidth = copy_bandwidth(device, bc.copy_mib * 2**20)
    records: list[dict[str, Any]] = []
    kept = RecordLog(os.path.join(bc.out, RECORDS_FILE))
    with keeping("the bench", kept), \
            tqdm(total=len(bc.presets) * len(bc.drafts) * bc.repeats, desc="bench", unit="round") as progress:
        for preset in bc.presets:
            progress.set_postfix(preset=preset)
            measured = bench_preset(bc, preset, bandwidth, progress)
            for r in measured:
                kept.append(r)
            records += measured
    try:
        write_bench(bc, records, bandwidth)
    except Exception as e:
        raise late_failure("writing the bench's files", e, [os.path.join(bc.out, "bench.json"), kept.path]) from e
    return records


def write_bench(bc: BenchConfig, records: list[dict[str, Any]], bandwidth: float) -> None:
    """bench.json (first), bench.md and bench.png into ``bc.out``, each whole or not at all."""
    device = torch.device(bc.device)
    out = Path(bc.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine()),
        cpu_count=os.cpu_count(), torch=torch.__version__, copy_bandwidth_gb_s=bandwidth / 1e9,
        config=dataclasses.asdict(bc),
    )
    capacity = ", ".join(dict.fromkeys(f"{r['preset']} {r['max_seq_len']}" for r in records))  # max_seq_len in effect
    projected = projections(records, parse_dtype(bc.dtype))
    write_json(str(out / "bench.json"), dict(meta=meta, records=records, projection=projected))
    write_text(str(out / "bench.md"),
               f"Device: {meta['device']} ({bc.device}, {bc.dtype}); copy bandwidth {meta['copy_bandwidth_gb_s']:.1f} "
               f"GB/s; {bc.context} context rows; capacity {capacity} rows; median of {bc.repeats} "
               "runs.\n\n" + markdown_table(records)
               + (f"\n{projection_table(projected)}" if projected else ""))
    with replaced(str(out / "bench.png")) as tmp:
        plot(records, Path(tmp))


def run_target_costs(bc: BenchConfig) -> dict[str, Any]:
    """The speedup model's costs: measured for the toy target with each backend, and GLM-5's
    from bytes; writes ``costs.json`` (top level: the first backend's, what ``speedup.costs=PATH``
    reads) and ``costs.md``."""
    from .targets.checkpoint import load_checkpoint
    from .loop.speculative import make_proposer
    from .loop.speedup import glm5_costs, measure_costs
    from .targets.target import Target

    model = load_checkpoint(bc.checkpoint, parse_dtype("float32"))
    max_seq_len = min(bc.max_seq_len, model.target.config.max_position_embeddings)
    target = Target(model.target, max_seq_len)
    gen = torch.Generator().manual_seed(bc.seed)
    context = torch.randint(model.target.config.vocab_size, (bc.context,), generator=gen).tolist()
    kmax = max(bc.drafts)
    per_backend = {}
    kept = RecordLog(os.path.join(bc.out, RECORDS_FILE))
    with keeping("the target costs", kept, "backend(s)"):
        for name in bc.backends:
            proposer = make_proposer(name, model.mtp, max_seq_len)
            per_backend[name] = {**measure_costs(target, proposer, kmax, context, bc.repeats), "backend": name}
            kept.append(per_backend[name])
    first = per_backend[bc.backends[0]]
    glm5 = glm5_costs(kmax)
    meta = dict(device=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                torch_threads=torch.get_num_threads(),
                torch=torch.__version__, checkpoint=model.path, dtype="float32", context=bc.context)
    costs = {**first, "per_backend": per_backend, "glm5": glm5, "meta": meta}
    out = Path(bc.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(str(out / "costs.json"), costs)  # whole or not at all: speedup.costs=PATH reads it
    ks = range(1, kmax + 1)
    lines = [f"Toy target ({model.path}, float32, {bc.context} context tokens, {meta['torch_threads']} thread(s), "
             f"median of {bc.repeats}); GLM-5 from the bytes each step reads (weights only; routing uniform and "
             "independent).", "",
             "| target | backend | target step ms | draft step ms | c | " + " | ".join(f"v({k})" for k in ks) + " |",
             "|" + "---|" * (5 + kmax)]
    for name, r in per_backend.items():
        lines.append(f"| toy (this machine) | {name} | {r['target_step_ms']:.2f} | {r['draft_step_ms']:.2f} | "
                     f"{r['c']:.3f} | "
                     + " | ".join(f"{x:.3f}" for x in r["v"]) + " |")
    lines.append(f"| GLM-5 (bytes) | — | {glm5['target_step_params'] / 1e9:.2f} G params | "
                 f"{glm5['draft_step_params'] / 1e9:.2f} G params | "
                 f"{glm5['c']:.4f} | " + " | ".join(f"{x:.3f}" for x in glm5["v"]) + " |")
    write_text(str(out / "costs.md"), "\n".join(lines) + "\n")
    return costs


def bench_parser() -> argparse.ArgumentParser:
    """The bench's flags (``parse_args`` checks them)."""
    p = argparse.ArgumentParser(prog="python -m glm_mtp.experiments.bench",
                                description="Propose latency and memory, reference vs optimized, against the "
                                            "bandwidth floor.")
    p.add_argument("--presets", nargs="+", default=None, help="default: tiny small glm5_shape (+ glm5 on cuda)")
    p.add_argument("--backends", nargs="+", default=["reference", "optimized"], choices=sorted(BACKENDS))
    p.add_argument("--drafts", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="replace the presets' max_position_embeddings, which caps --max-seq-len (small: 4096)")
    p.add_argument("--repeats", type=int, default=None, help="default: 7 on cpu, 30 on cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--copy-mib", type=int, default=None, help="default: 256 on cpu, 2048 on cuda")
    p.add_argument("--seed", type=ranged_int(0, SEED_MAX), default=0)
    p.add_argument("--counters", nargs="*", default=None, metavar="PRESET",
                   help="presets whose draft-step launches and bytes are counted in Triton's CPU interpreter "
                        "(a CPU subprocess each; default on cpu: those of tiny small that run, on cuda: none; "
                        "none: --counters with no preset)")
    p.add_argument("--out", default=None, help="default: outputs/bench/<device>-<time>")
    p.add_argument("--target-costs", action="store_true",
                   help="measure the speedup model's c and v(k) on the toy target (costs.json)")
    p.add_argument("--checkpoint", default=None,
                   help="--target-costs: the toy target's checkpoint directory (default: the shipped one)")
    return p


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """The bench's flags, every one checked before any measurement (``p.error``: exit status 2, one line)."""
    p = bench_parser()
    a = p.parse_args(argv)
    device = checked_device(p, a.device)
    cuda = device.type == "cuda"
    check_counts(p, a)
    presets = checked_presets(p, a, cuda)
    counted = checked_counters(p, a, presets, cuda)
    check_lengths(p, a, presets)
    check_target_costs(p, a, device)
    out = a.out or os.path.join("outputs", "bench", f"{a.device.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}")
    if why := unwritable_dir(out):  # before the measurements, not after them
        p.error(f"--out {why}")
    return BenchConfig(
        presets=presets, backends=a.backends, drafts=a.drafts, device=a.device, dtype=a.dtype, context=a.context,
        max_seq_len=a.max_seq_len, max_position_embeddings=a.max_position_embeddings,
        repeats=a.repeats if a.repeats is not None else (30 if cuda else 7), warmup=a.warmup,
        copy_mib=a.copy_mib if a.copy_mib is not None else (2048 if cuda else 256), seed=a.seed, out=out,
        counters=counted,
        target_costs=a.target_costs, checkpoint=a.checkpoint,
    )


def checked_device(p: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device``: cpu or an existing cuda[:N]."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        p.error(f"--device {name!r} is not a device ({e})")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda[:N], got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        p.error(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_counts(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The counts' lower bounds. None means the device's default; 0 or a negative count is refused,
    never replaced silently."""
    if any(k < 1 for k in a.drafts):
        p.error("--drafts must be >= 1")
    for name, minimum in (("repeats", 1), ("copy_mib", 1), ("context", 1), ("warmup", 0), ("max_seq_len", 1),
                          ("max_position_embeddings", 1)):
        value = getattr(a, name)
        if value is not None and value < minimum:
            p.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def checked_presets(p: argparse.ArgumentParser, a: argparse.Namespace, cuda: bool) -> list[str]:
    """``--presets`` (or the device's default list), each a known preset."""
    presets = a.presets or (["tiny", "small", "glm5_shape", "glm5"] if cuda else ["tiny", "small", "glm5_shape"])
    for name in presets:
        try:
            MtpConfig.preset(name)
        except ValueError as e:
            p.error(str(e))
    return presets


def checked_counters(p: argparse.ArgumentParser, a: argparse.Namespace, presets: list[str], cuda: bool) -> list[str]:
    """The presets whose draft step is counted: ``--counters``, each among the presets run. The
    counters do not depend on the device (a CPU subprocess): a CUDA run leaves them to the CPU bench
    unless asked (scripts/gpu_check.sh gives the bench 200 s)."""
    counted = ([] if cuda else [n for n in COUNTER_PRESETS if n in presets]) if a.counters is None else a.counters
    for name in counted:
        if name not in presets:
            p.error(f"--counters {name}: not among the presets run ({' '.join(presets)})")
    return counted


def check_lengths(p: argparse.ArgumentParser, a: argparse.Namespace, presets: list[str]) -> None:
    """The rows a measurement holds, ``--context + max(--drafts) + 2``, fit the capacity asked for
    and every preset's context (``max_position_embeddings``, or the flag that replaces it), which
    caps a drafter's ``max_seq_len``."""
    rows = a.context + max(a.drafts) + 2
    if rows > a.max_seq_len:
        p.error("--max-seq-len must exceed --context + max(--drafts) + 2")
    if a.max_position_embeddings is not None:
        if rows > a.max_position_embeddings:
            p.error("--max-position-embeddings must exceed --context + max(--drafts) + 2 (the drafter's context caps "
                    "max_seq_len)")
        return
    for name in presets:
        cap = MtpConfig.preset(name).max_position_embeddings
        if rows > cap:
            p.error(f"--context {a.context} + max(--drafts) + 2 = {rows} rows exceed preset {name}'s context "
                    f"(max_position_embeddings {cap}, which caps max_seq_len); lower --context or pass "
                    "--max-position-embeddings")


# The propose bench's flags that --target-costs does not read (it reads --backends, --drafts,
# --context, --max-seq-len, --repeats, --seed, --out and --checkpoint).
TARGET_COSTS_UNREAD = ("presets", "dtype", "max_position_embeddings", "warmup", "copy_mib", "counters")


def check_target_costs(p: argparse.ArgumentParser, a: argparse.Namespace, device: torch.device) -> None:
    """``--target-costs`` runs on the CPU and reads none of ``TARGET_COSTS_UNREAD``; ``--checkpoint``
    goes with it and is a checkpoint directory."""
    if a.checkpoint is not None and not a.target_costs:
        p.error("--checkpoint is the toy target of --target-costs; pass --target-costs too")
    if a.target_costs and device.type != "cpu":
        p.error("--target-costs runs on the CPU (the experiments' target is eager torch)")
    if a.target_costs:  # flags of the propose bench that --target-costs does not read: refused, never dropped
        for name in TARGET_COSTS_UNREAD:
            value = getattr(a, name)
            if value != p.get_default(name) and not (name == "dtype" and value == "float32"):
                p.error(f"--{name.replace('_', '-')} {value}: --target-costs does not read it (it times the toy "
                        "target and the drafter in float32 at --context, --max-seq-len, --drafts, --repeats); "
                        "leave it unset")
    if a.checkpoint is None:
        return
    from glm_mtp.reference.checkpoint import check_checkpoint_directory

    try:
        check_checkpoint_directory("--checkpoint", a.checkpoint)
    except ValueError as e:
        p.error(str(e))
    if not os.path.isfile(os.path.join(a.checkpoint, "config.json")):
        p.error(f"--checkpoint: {a.checkpoint} holds no config.json (not a checkpoint directory)")
    from .targets.checkpoint import check_checkpoint_loads

    try:
        check_checkpoint_loads("--checkpoint", a.checkpoint, "float32", package_target=True)
    except ValueError as e:
        p.error(str(e))


PROG = "python -m glm_mtp.experiments.bench"


def main(argv: list[str] | None = None) -> None:
    bc = parse_args(argv)
    exit_on_late_failure(PROG, lambda: measure_and_print(bc))


def measure_and_print(bc: BenchConfig) -> None:
    """Run what ``bc`` asks (the bench, or ``--target-costs``) and print its tables."""
    if bc.target_costs:
        run_target_costs(bc)
        print((Path(bc.out) / "costs.md").read_text())
        print(f"wrote {bc.out}/costs.json, costs.md")
        return
    records = run(bc)
    print(markdown_table(records))
    projected = projections(records, parse_dtype(bc.dtype))
    if projected:
        print(projection_table(projected))
    print(f"wrote {bc.out}/bench.json, bench.md, bench.png")


if __name__ == "__main__":
    main()
