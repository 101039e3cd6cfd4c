"""Sharded drafters against the single-rank reference, one process per rank.

``check_sharded(world, ...)`` launches ``world`` ranks (gloo on CPU, NCCL on CUDA); every rank
builds the same full weights, shards them, and drives a sharded drafter and a single-rank
``ReferenceProposer`` in lockstep through realistic spec-decode scenarios (DESIGN.md §4),
comparing drafts and ``export_state`` bytes after every step. Every rank also checks that all
ranks hold the same bytes. Results come back as one JSON record per rank.

    python -m glm_mtp.conformance.sharded --world 2 --backend reference --scenarios 8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import raw_bytes
from glm_mtp.ranges import SEED_MAX, ranged_int
from glm_mtp.reference.distributed import launch
from glm_mtp.registry import BACKENDS, backend_class, parse_dtype

# The weight dtypes this check is run with (names of glm_mtp.registry.DTYPES).
SHARDED_DTYPES = ("bfloat16", "float32")


def snapshot(prop: Any, state: Any) -> dict[str, bytes]:
    return {k: raw_bytes(v) for k, v in prop.export_state(state).items()}


def make_backend(name: str, weights: MtpWeights, max_seq_len: int) -> Any:
    """A drafter of backend ``name`` (a key of ``glm_mtp.registry.BACKENDS``) on ``weights``."""
    return backend_class(name)(weights, max_seq_len)


def sharded_rank(rank: int, world: int, opts: dict[str, Any]) -> None:
    """One rank's lockstep run; writes ``rank{rank}.json`` into ``opts['out']``."""
    device = torch.device(opts["device"] if opts["device"] != "cuda" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    cfg = MtpConfig.preset(opts["preset"])
    dtype = parse_dtype(opts["dtype"])
    full = MtpWeights.random(cfg, seed=opts["seed"], dtype=dtype, device=device)
    sharded = full.shard(rank, world, row_parallel_o_proj=opts["row_parallel_o_proj"])
    max_seq_len = opts["max_seq_len"]
    base, cand = ReferenceProposer(full, max_seq_len), make_backend(opts["backend"], sharded, max_seq_len)
    H, V = cfg.hidden_size, cfg.vocab_size
    record: dict[str, Any] = dict(
        rank=rank, world=world, needs_comm=cand.needs_comm(), steps=0, byte_mismatch_steps=0, draft_total=0,
        draft_agree=0, max_abs_diff_x=0.0, first_mismatch=None,
        experts_held=int(sharded.layer.mlp.experts_gate.shape[0]),  # type: ignore[union-attr]  # a sharded layer's mlp is a MoE, which has experts_gate
    )
    digest = hashlib.sha256()
    for s in range(opts["scenarios"]):
        gen = torch.Generator(device).manual_seed(opts["seed"] * 1000 + s)  # the same on every rank

        def randint(hi: int, gen: torch.Generator = gen) -> int:
            return int(torch.randint(hi, (1,), generator=gen, device=device))

        def hiddens(n: int, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(n, H, generator=gen, device=device).to(dtype)

        states = [p.alloc_state(device) for p in (base, cand)]
        n = 2 + randint(20)
        plan: list[tuple] = [("prefill", torch.randint(V, (n,), generator=gen, device=device), hiddens(n))]
        m, token, h_prev = n, randint(V), hiddens(1)[0]
        for _ in range(opts["rounds"]):
            k = 1 + randint(opts["max_drafts"])
            a = randint(k + 1)
            verified = hiddens(k + 1)  # the target's h_m .. h_{m+k}
            plan += [("propose", token, h_prev, m - 1, k), ("after_verify", a)]
            if a == k:  # one row behind: d_k (known once drafted) with h_{m+k-1}
                plan.append(("catchup", verified[k - 1 : k], m + k - 1))
            m, token, h_prev = m + a + 1, randint(V), verified[a]
        last_draft = 0
        for i, (name, *args) in enumerate(plan):
            outs = []
            for p, st in zip((base, cand), states):
                if name == "prefill":
                    outs.append(p.prefill_drafter(args[0], args[1], st))
                elif name == "propose":
                    outs.append(p.propose(*args, st))
                elif name == "after_verify":
                    outs.append(p.after_verify(args[0], st))
                else:
                    outs.append(p.catchup_drafter([last_draft], args[0], args[1], 0, st))
            if name == "propose" and outs[0]:
                last_draft = outs[0][-1]
            record["steps"] += 1
            sb, sc = snapshot(base, states[0]), snapshot(cand, states[1])
            for v in sc.values():
                digest.update(v)
            digest.update(repr(outs[1]).encode())
            if name == "propose":
                record["draft_total"] += len(outs[0])
                record["draft_agree"] += sum(int(x == y) for x, y in zip(outs[0], outs[1]))
                ex, cx = base.export_state(states[0])["x"].float(), cand.export_state(states[1])["x"].float()
                record["max_abs_diff_x"] = max(record["max_abs_diff_x"], float((ex - cx).abs().max()))
            if sb != sc or outs[0] != outs[1]:
                record["byte_mismatch_steps"] += 1
                if record["first_mismatch"] is None:
                    keys = [k for k in sb if sb[k] != sc.get(k)]
                    record["first_mismatch"] = dict(scenario=s, step=i, op=name, tensors=keys,
                                                    drafts=[outs[0], outs[1]])
            if name == "propose" and outs[0] != outs[1]:
                # Drafts steer the rest of a scenario (the catch-up feeds d_k): stop comparing it.
                break
        for p, st in zip((base, cand), states):
            p.free_state(st)
    # Every rank must hold the same bytes and return the same drafts.
    mine = torch.tensor(list(digest.digest()), dtype=torch.uint8, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    record["ranks_agree"] = all(torch.equal(parts[0], q) for q in parts)
    with open(os.path.join(opts["out"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


class SingleRankBaseline(ReferenceProposer):
    """The single-rank reference as the baseline of a sharded run. ``needs_comm`` is the one
    answer a sharded drafter gives differently by design; every byte must still agree."""

    def needs_comm(self) -> bool:
        return True


def runner_rank(rank: int, world: int, opts: dict[str, Any]) -> None:
    """One rank of ``check_sharded_runner``: the conformance runner's realistic scenarios with a
    sharded candidate against the single-rank reference; writes ``rank{rank}.json``."""
    from .runner import run

    torch.use_deterministic_algorithms(True)

    def sharded(weights: MtpWeights, max_seq_len: int) -> Any:
        return make_backend(opts["backend"], weights.shard(rank, world, row_parallel_o_proj=False), max_seq_len)

    report = run(sharded, SingleRankBaseline, scenarios=opts["scenarios"], seed=opts["seed"],
                 dtype=parse_dtype(opts["dtype"]),
                 preset=opts["preset"], generators=("realistic",))
    with open(os.path.join(opts["out"], f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, ok=report.ok, scenarios_run=report.scenarios_run, steps_run=report.steps_run,
                       first_difference=None if report.ok else report.summary()), f)


def check_sharded_runner(
    world: int,
    backend: str = "reference",
    scenarios: int = 10,
    seed: int = 0,
    dtype: str = "bfloat16",
    preset: str = "tiny",
    timeout_s: float = 240.0,
) -> list[dict[str, Any]]:
    """``glm_mtp.conformance.run`` on every rank of ``world`` gloo ranks: a sharded candidate
    (expert-parallel, whole ``o_proj``) against the single-rank reference, byte for byte."""
    with tempfile.TemporaryDirectory() as out:
        opts = dict(backend=backend, scenarios=scenarios, seed=seed, dtype=dtype, preset=preset, out=out)
        launch(runner_rank, world, opts, timeout_s=timeout_s)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def faulty_rank(rank: int, world: int, fault: str) -> None:
    """Fault injection for the launcher's tests: the last rank dies (``die``) or never joins a
    collective (``stall``) while the others all-reduce."""
    if rank == world - 1:
        if fault == "die":
            os._exit(3)
        import time

        time.sleep(3600)
    t = torch.ones(4)
    dist.all_reduce(t)


def check_sharded(
    world: int, backend: str = "reference", preset: str = "tiny", dtype: str = "float32", scenarios: int = 6,
    rounds: int = 6, max_drafts: int = 4, seed: int = 0, row_parallel_o_proj: bool = False, device: str = "cpu",
    max_seq_len: int = 128, timeout_s: float = 240.0,
) -> list[dict[str, Any]]:
    """Run the sharded lockstep check on ``world`` ranks; returns each rank's record."""
    with tempfile.TemporaryDirectory() as out:
        opts = dict(
            backend=backend, preset=preset, dtype=dtype, scenarios=scenarios, rounds=rounds, max_drafts=max_drafts,
            seed=seed, row_parallel_o_proj=row_parallel_o_proj, device=device, max_seq_len=max_seq_len, out=out,
        )
        launch(sharded_rank, world, opts, timeout_s=timeout_s, backend="nccl" if device == "cuda" else "gloo")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def settings_error(a: argparse.Namespace) -> str | None:
    """Why the flags cannot run (checked before any rank is spawned), or ``None``: a known
    ``--preset``, a ``--world`` that divides its routed experts (each rank holds an equal block),
    a power-of-two ``--world`` with ``--row-parallel-o-proj`` (each rank sums an aligned subtree of
    ``o_proj``'s psum), and ``--device cuda`` with a GPU per rank."""
    try:
        cfg = MtpConfig.preset(a.preset)
    except ValueError as e:
        return f"--preset: {e}"
    if cfg.n_routed_experts % a.world:
        return (f"--world {a.world} must divide the routed experts of --preset {a.preset} "
                f"(n_routed_experts={cfg.n_routed_experts}): each rank holds an equal block")
    if a.row_parallel_o_proj and a.world & (a.world - 1):
        return (f"--row-parallel-o-proj needs a power-of-two --world (each rank sums an aligned subtree of o_proj's "
                f"psum), got {a.world}")
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        return f"--device cuda runs a rank per GPU: --world {a.world}, but {torch.cuda.device_count()} GPU(s) visible"
    return None


def error(message: str) -> int:
    print(f"python -m glm_mtp.conformance.sharded: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm_mtp.conformance.sharded",
                                description="Sharded drafter vs the single-rank reference, one process per rank.")
    p.add_argument("--world", type=ranged_int(1), default=2)
    p.add_argument("--backend", default="reference", choices=sorted(BACKENDS))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32", choices=SHARDED_DTYPES)
    p.add_argument("--scenarios", type=ranged_int(1), default=6)
    p.add_argument("--seed", type=ranged_int(0, SEED_MAX), default=0)
    p.add_argument("--row-parallel-o-proj", action="store_true",
                   help="split o_proj's inputs over the ranks (tree-aligned: bit-exact; a power-of-two world)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args(argv)
    if (why := settings_error(a)) is not None:
        return error(why)
    try:
        recs = check_sharded(a.world, a.backend, a.preset, a.dtype, a.scenarios, seed=a.seed,
                             row_parallel_o_proj=a.row_parallel_o_proj, device=a.device)
    except Exception as e:  # a rank that crashed is not a difference: exit 1 must mean one
        return error(f"the run failed ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    for r in recs:
        print(json.dumps(r))
    exact = all(r["byte_mismatch_steps"] == 0 and r["ranks_agree"] for r in recs)
    print("byte-identical to the single-rank reference:", exact)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
