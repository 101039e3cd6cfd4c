"""The speedup model of speculative decoding: what k buys at a given drafter and target cost.

One speculative step drafts k tokens (k draft steps) and verifies them in one target forward of
k + 1 tokens; it commits tau(k) tokens on average. Against plain decoding (one target step per
token), the predicted speedup is

    S(k) = tau(k) / (1 + k * c + v(k))

with costs in units of one target decode step (1 token):

- ``c``: one draft step of the MTP drafter (one MTP layer + the head);
- ``v(k)``: the extra cost of verifying k more tokens, ``(verify of k + 1 tokens) / (1 token) - 1``
  (0 when a verify is as fast as a decode step, as in a memory-bound regime with dense layers);
- ``tau(k) = 1 + sum_{i <= k} P(accepted >= i)``: tokens committed per verification, from the
  acceptance counts. A run with K drafts gives tau(k) for every k <= K: drafts are made one after
  another, so drafts 1..k and their verdicts are the same whether K = k or more were made (exact
  in teacher-forced mode; in the loop the contexts a run visits depend on K, so tau(k < K) is an
  estimate from K's trajectories).

A verify width that varies per step (a stop rule verifies s <= k of the k drafts, the hindsight
oracle exactly the ones the target accepts): every step still drafts k, and a step of width s
costs ``1 + k c + v(s)`` with ``v(0) = 0`` (a verify of one token is a decode step), so over the
run's steps

    S = committed / sum_steps (1 + k c + v(s_step)) = tau / (1 + k c + sum_s h(s) v(s))

with ``h(s)`` the share of steps of width s (``width_speedup``); at ``h(k) = 1`` this is S(k).

Costs come from three places:

- cost tables (``cost_tables.py``: the target's forward at widths 1..W and the drafter's step in
  ms, measured by an engine on some hardware, each with its public source and the numbers that
  were derived; shipped ones under ``costs/``, or a user's file), checked against published
  speedups by ``cost_check.py``;

- ``measure_costs``: timed on this machine for a given target and drafter (the toy target of the
  experiments), medians of alternating repeats (``experiments/bench.py --target-costs`` writes
  them to ``costs.json``; the acceptance run measures them for its own target and drafter);
- ``bytes_costs``: the memory-bound limit, from the bytes each step must read (weights only), for a
  released model (``preset_costs``: GLM-5, or GLM-5.3-Flash for the glm5_next family); for GLM-5:
  a draft step reads one MTP layer (attention, router, shared expert, 8 routed experts) + the
  head; a target step reads 78 layers (3 dense) + the head; a verify of n tokens reads, per MoE
  layer, the experts the n tokens choose: ``E * (1 - (1 - topk / E)^n)`` of them when routing is
  uniform and independent (real routing is correlated, so this is an upper bound on v).

Intervals: the bootstrap over prompts of ``stats.py`` applied to tau(k); c and v are taken as
fixed (their spread over repeats is recorded beside them).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from glm_mtp.reference.config import MtpConfig
from glm_mtp.tools.floor import floor_bytes_per_draft

from . import cost_tables
from . import stats as acc_stats

# ------------------------------------------------------------------------------------------------
# The model


def tau_by_k(cumulative: list[float]) -> list[float]:
    """tau(k) for k = 1..K from the cumulative acceptance P(accepted >= i), i = 1..K."""
    return [1.0 + float(sum(cumulative[:k])) for k in range(1, len(cumulative) + 1)]


def predict(tau: list[float], c: float, v: list[float]) -> list[float]:
    """S(k) = tau(k) / (1 + k c + v(k)) for k = 1..len(tau)."""
    if len(v) < len(tau):
        raise ValueError(f"v must hold one value per k: {len(v)} values for {len(tau)} k")
    return [t / (1.0 + (k + 1) * c + v[k]) for k, t in enumerate(tau)]


def best_k(predicted: list[float]) -> int:
    """The k (1-based) of the largest predicted speedup; ties to the smaller k."""
    return int(np.argmax(np.asarray(predicted))) + 1


def speedup_summary(counts_per_prompt: dict[str, Any], c: float, v: list[float], seed: int = 0,
                    replicates: int = acc_stats.REPLICATES, source: str = "") -> dict[str, Any]:
    """The ``speedup`` record of an acceptance summary: ``c``, ``v`` (one per k), ``tau`` and
    ``predicted`` (one per k), their bootstrap 95% intervals over prompts, ``best_k`` and the
    share of replicates that pick each k (how sure the best k is)."""
    r, a, s = (np.asarray(counts_per_prompt[k], dtype=np.float64) for k in ("reached", "accepted", "steps"))
    K = r.shape[1]
    point = acc_stats.point_stats(r, a, s)
    tau = tau_by_k(point["cumulative"].tolist())
    pred = predict(tau, c, v)
    idx = acc_stats._replicate_indices(r.shape[0], replicates, seed)
    rep = acc_stats.point_stats(r[idx], a[idx], s[idx])["cumulative"]  # (B, K)
    rep_tau = 1.0 + np.cumsum(np.nan_to_num(rep), axis=1)
    denom = 1.0 + np.arange(1, K + 1) * c + np.asarray(v[:K])
    rep_s = rep_tau / denom
    picks = np.bincount(rep_s.argmax(axis=1), minlength=K) / rep_s.shape[0]
    return {"c": float(c), "v": [float(x) for x in v[:K]], "tau": tau, "tau_ci": acc_stats._percentiles(rep_tau),
            "predicted": pred, "predicted_ci": acc_stats._percentiles(rep_s), "best_k": best_k(pred),
            "best_k_share": [float(x) for x in picks], "costs": source}


def verify_cost(width: int, v: list[float]) -> float:
    """v(s): the extra cost of a verify of ``width`` drafts; v(0) = 0 (``v`` holds v(1), v(2), ..)."""
    if width < 0 or width > len(v):
        raise ValueError(f"width must be in [0, {len(v)}] (v holds one value per width >= 1), got {width}")
    return 0.0 if width == 0 else float(v[width - 1])


def width_speedup(committed: float, widths: list[float], c: float, v: list[float],
                  draft_steps: float | None = None) -> float:
    """S at a verify width that varies per step.

    Args:
        committed: tokens the steps committed.
        widths: per width s = 0..K, the steps that verified s drafts (their sum is the steps).
        c / v: a draft step's cost and v(s) for s = 1..K (``verify_cost``), in target steps.
        draft_steps: draft steps made over all steps; None: K per step (the drafter drafts every
            one of the K drafts, whatever the verify keeps).
    """
    K = len(widths) - 1
    steps = float(sum(widths))
    drafted = K * steps if draft_steps is None else float(draft_steps)
    cost = steps + drafted * c + sum(n * verify_cost(s, v) for s, n in enumerate(widths) if n)
    return committed / cost if cost else float("nan")


def width_speedup_summary(per_prompt: dict[str, Any], c: float, v: list[float], seed: int = 0,
                          replicates: int = acc_stats.REPLICATES,
                          drafted: list[float] | None = None) -> dict[str, Any]:
    """``tau``, ``predicted`` (S, ``width_speedup``) and ``mean_width`` with bootstrap 95%
    intervals over prompts, and the pooled ``width_histogram``.

    Args:
        per_prompt: ``{"committed": [P], "widths": [P x (K + 1)]}``: per prompt, tokens committed
            and steps per verify width.
        c / v / seed / replicates: the costs (``width_speedup``) and the bootstrap's.
        drafted: per width s = 0..K, the draft steps a step of that width made; None: K each (a
            fused drafter drafts them all). ``min(s + 1, K)``: a drafter that stops at the first
            draft the rule refuses.
    """
    com = np.asarray(per_prompt["committed"], dtype=np.float64)  # (P,)
    wid = np.asarray(per_prompt["widths"], dtype=np.float64)  # (P, K + 1)
    if wid.ndim != 2 or com.shape != wid.shape[:1] or not com.size:
        raise ValueError(f"per_prompt must hold P >= 1 prompts: committed (P,), widths (P, K + 1); got {com.shape}, "
                         f"{wid.shape}")
    K = wid.shape[1] - 1
    vs = np.asarray([verify_cost(s, v) for s in range(K + 1)])  # (K + 1,)
    ds = np.full(K + 1, float(K)) if drafted is None else np.asarray(drafted, dtype=np.float64)  # (K + 1,)
    if ds.shape != (K + 1,):
        raise ValueError(f"drafted must hold one count per width 0..{K}, got {len(ds)}")
    idx = acc_stats._replicate_indices(com.shape[0], replicates, seed)  # (B, P)

    def stats(com_sum: np.ndarray, wid_sum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        steps = wid_sum.sum(-1)
        cost = steps + (wid_sum * (c * ds + vs)).sum(-1)
        mean_width = (wid_sum * np.arange(K + 1)).sum(-1)
        return acc_stats._ratio(com_sum, steps), acc_stats._ratio(com_sum, cost), acc_stats._ratio(mean_width, steps)

    tau, pred, width = stats(com.sum(0), wid.sum(0))
    rtau, rpred, rwidth = stats(com[idx].sum(1), wid[idx].sum(1))
    return {"tau": float(tau), "tau_ci": acc_stats._percentiles(rtau[:, None])[0], "predicted": float(pred),
            "predicted_ci": acc_stats._percentiles(rpred[:, None])[0], "mean_width": float(width),
            "mean_width_ci": acc_stats._percentiles(rwidth[:, None])[0],
            "width_histogram": [int(x) for x in wid.sum(0)], "c": float(c), "v": [float(x) for x in v[:K]]}


# ------------------------------------------------------------------------------------------------
# Costs from bytes (GLM-5)


def attention_params(cfg: MtpConfig) -> int:
    """Weights of one DSA attention block (MLA + lightning indexer) and the layer's two norms."""
    H, nh, Lq, Lkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    R = cfg.qk_rope_head_dim
    D = cfg.index_head_dim
    return (2 * H + Lq * H + Lq + nh * cfg.qk_head_dim * Lq + (Lkv + R) * H + Lkv
            + nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) * Lkv
            + H * nh * cfg.v_head_dim + cfg.index_n_heads * D * Lq + D * H + 2 * D + cfg.index_n_heads * H)


def expected_experts(cfg: MtpConfig, tokens: int) -> float:
    """Distinct routed experts ``tokens`` tokens choose in one layer, routing uniform and independent."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return E * (1.0 - (1.0 - k / E) ** tokens)


def target_step_params(cfg: MtpConfig, tokens: int = 1) -> float:
    """Weights a target forward of ``tokens`` tokens reads: the embedding rows, every layer (dense
    MLP for the first ``first_k_dense_replace``, else router + shared + the experts chosen), the
    final norm and the head."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    dense = cfg.first_k_dense_replace
    moe_layers = cfg.num_hidden_layers - dense
    per_moe = cfg.n_routed_experts * H + cfg.n_shared_experts * 3 * I * H + expected_experts(cfg, tokens) * 3 * I * H
    return (tokens * H + cfg.num_hidden_layers * attention_params(cfg) + dense * 3 * cfg.intermediate_size * H
            + moe_layers * per_moe + H + cfg.vocab_size * H)


def draft_step_params(cfg: MtpConfig) -> float:
    """Weights one draft step reads (``floor_bytes_per_draft`` at no context, in parameters)."""
    return (floor_bytes_per_draft(cfg, torch.int8, 0) - cfg.n_routed_experts * 4)  # int8: one byte a parameter


def bytes_costs(cfg: MtpConfig, kmax: int) -> dict[str, Any]:
    """c and v(k), k = 1..kmax, from the weights each step reads (memory-bound, short context)."""
    t1 = target_step_params(cfg, 1)
    return {"c": draft_step_params(cfg) / t1,
            "v": [target_step_params(cfg, k + 1) / t1 - 1.0 for k in range(1, kmax + 1)],
            "target_step_params": t1, "draft_step_params": draft_step_params(cfg),
            "verify_params": [target_step_params(cfg, k + 1) for k in range(1, kmax + 1)], "source": "bytes"}


def glm5_costs(kmax: int) -> dict[str, Any]:
    """``bytes_costs`` of GLM-5 (``MtpConfig.preset('glm5')``)."""
    return preset_costs("glm5", kmax)


def preset_costs(preset: str, kmax: int) -> dict[str, Any]:
    """``bytes_costs`` of a released model's preset (``glm5``: GLM-5; ``glm5next``: GLM-5.3-Flash),
    its ``source`` ``bytes:<preset>``."""
    return {**bytes_costs(MtpConfig.preset(preset), kmax), "source": f"bytes:{preset}"}


# The released model of each drafter family (MtpConfig.family): its preset and its name. A toy's
# drafter costs about as much as its toy target (one layer beside three), so its own S(k) shows a
# slowdown; the released model's drafter reads a few percent of its target's bytes.
RELEASED = {"glm5": ("glm5", "GLM-5"), "glm5_next": ("glm5next", "GLM-5.3-Flash")}
# The measured cost table of each family's released model (cost_tables.py; DESIGN.md §15): GLM-5.2
# (GLM-5's architecture) on 8 x H200 at batch 1, derived from mstar#272's speedup; GLM-5.3-Flash on
# an M5 Max (ds4#892's measured forwards and draft step).
RELEASED_TABLES = {"glm5": "glm52-h200x8-mstar", "glm5_next": "glm53flash-m5max-ds4"}


def released_speedup(counts_per_prompt: dict[str, Any], family: str, kmax: int, seed: int = 0) -> dict[str, Any]:
    """``speedup_summary`` of these acceptance counts at the measured cost table of the released
    model of the drafter's ``family`` (``RELEASED_TABLES``), with ``model`` (its name), ``preset``,
    ``table`` (the table's provenance), ``extrapolated`` (the k whose verify lies beyond the
    table's widths) and ``bound``: the same at the bytes each step reads (``preset_costs``, the
    memory-bound limit: S can be no lower on a machine whose forwards are bandwidth-bound).

    Args:
        counts_per_prompt: the run's ``reached``, ``accepted`` and ``steps`` per prompt.
        family: the drafter's ``MtpConfig.family``.
        kmax: the run's num_drafts (v(k) for k <= kmax).
        seed: the bootstrap's seed (the run's).
    """
    preset, name = RELEASED[family]
    table = cost_tables.shipped_table(RELEASED_TABLES[family])
    costs = cost_tables.costs_at(table, kmax)
    bound = preset_costs(preset, kmax)
    return {**speedup_summary(counts_per_prompt, costs["c"], costs["v"], seed=seed, source=costs["source"]),
            "model": name, "preset": preset, "table": costs["table"], "extrapolated": costs["extrapolated"],
            "bound": speedup_summary(counts_per_prompt, bound["c"], bound["v"], seed=seed, source=bound["source"])}


def per_batch_summary(counts_per_prompt: dict[str, Any], costs: dict[str, Any],
                      seed: int = 0) -> list[dict[str, Any]] | None:
    """With a per-batch cost table (``costs["per_batch"]``), per batch size its ``c``, ``v``,
    ``predicted`` S(k) and ``best_k`` at these acceptance counts; None for costs of one batch size."""
    if not costs.get("per_batch"):
        return None
    out = []
    for b in costs["per_batch"]:
        sp = speedup_summary(counts_per_prompt, b["c"], b["v"], seed=seed, source=b["source"])
        out.append({"batch": b["batch"], "c": sp["c"], "v": sp["v"], "predicted": sp["predicted"],
                    "predicted_ci": sp["predicted_ci"], "best_k": sp["best_k"], "extrapolated": b["extrapolated"]})
    return out


# ------------------------------------------------------------------------------------------------
# Costs measured on this machine


def measure_costs(target: Any, proposer: Any, kmax: int, context: list[int], repeats: int = 15,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time, on this machine, a target decode step (1 token after ``context``), a verify of k + 1
    tokens for k = 1..kmax, and a draft step (a propose of kmax drafts, per draft); medians over
    ``repeats`` rounds that alternate the measurements (so a busy spell hits all of them).
    Returns ``c``, ``v`` (one per k) and the medians in ms."""
    if len(context) < 2:
        raise ValueError("context must hold at least 2 tokens")
    P = len(context)
    tstate = target.alloc_state()
    out = target.prefill(list(context[:-1]), tstate)  # h_0..h_{P-2}
    dstate = proposer.alloc_state(out.hidden.device)
    proposer.prefill_drafter(context[:-1], out.hidden, dstate)  # rows [0, P-2)
    tok, h_prev = context[-1], out.hidden[-1:]
    fed = [tok] + [context[i % P] for i in range(kmax)]  # the token, then any k tokens

    def verify(n: int) -> float:
        t0 = clock()
        out = target.verify(fed[:n], tstate)
        if out.logits.is_cuda:  # the forward's kernels are queued: the time is theirs once they finished
            torch.cuda.synchronize(out.logits.device)
        dt = clock() - t0
        target.rollback(tstate, P - 1)
        return dt

    def draft() -> float:
        t0 = clock()
        proposer.propose(tok, h_prev, P - 2, kmax, dstate)
        dt = clock() - t0
        proposer.after_verify(0, dstate)
        return dt / kmax

    verify(1), verify(kmax + 1), draft()  # warm-up
    t_step, t_draft, t_verify = [], [], [[] for _ in range(kmax)]
    for _ in range(repeats):
        t_step.append(verify(1))
        t_draft.append(draft())
        for k in range(1, kmax + 1):
            t_verify[k - 1].append(verify(k + 1))
    proposer.free_state(dstate)
    step = statistics.median(t_step)
    return {"c": statistics.median(t_draft) / step, "v": [statistics.median(t) / step - 1.0 for t in t_verify],
            "target_step_ms": step * 1e3, "draft_step_ms": statistics.median(t_draft) * 1e3,
            "verify_ms": [statistics.median(t) * 1e3 for t in t_verify],
            "target_step_ms_iqr": [float(np.percentile(t_step, 25) * 1e3), float(np.percentile(t_step, 75) * 1e3)],
            "repeats": repeats, "context": P, "source": "measured"}


# ------------------------------------------------------------------------------------------------
# Presentation


def costs_label(sp: dict[str, Any]) -> str:
    """How a line names the costs of a speedup record: ``bytes:glm5, the memory-bound limit``; a
    table's name, model, hardware, engine, whether derived, and the k whose v was extrapolated."""
    source = str(sp.get("costs", ""))
    if source.startswith("bytes:"):
        return f"{source}, the memory-bound limit"
    table = sp.get("table") or (sp.get("cost_details") or {}).get("table")
    if source.startswith("table:") and table:
        kind = "derived from a published speedup" if table["derived_from_speedup"] else "measured"
        extra = sp.get("extrapolated", (sp.get("cost_details") or {}).get("extrapolated")) or []
        tail = f"; v at k = {', '.join(map(str, extra))} extrapolated linearly" if extra else ""
        return (f"{table['name']}: {table['model']} on {table['hardware']}, {table['engine']}, {kind}, "
                f"{table['source'].split(':')[0]}{tail}")
    return source


def format_line(sp: dict[str, Any], label: str = "predicted speedup") -> str:
    """``<label> S(1) = 1.23 [1.1, 1.3], ...; best k = 2 (c = 0.31, v = ..., costs ...)``."""
    cells = ", ".join(f"S({k + 1}) = {p:.2f} [{ci[0]:.2f}, "
                      f"{ci[1]:.2f}]" for k, (p, ci) in enumerate(zip(sp["predicted"], sp["predicted_ci"])))
    v = ", ".join(f"{x:.2f}" for x in sp["v"])
    return f"{label} {cells}; best k = {sp['best_k']} (c = {sp['c']:.3f}, v = [{v}], costs {costs_label(sp)})"


def released_line(released: dict[str, Any], measured_c: float) -> str:
    """The lines beside this run's S(k): the same acceptance at the released model's measured cost
    table (named with its source), at the bytes limit beside it (the bound), and why they differ
    from this run's (the drafter's cost c relative to its target's decode step)."""
    name = released["model"]
    line = format_line(released, f"at {name}'s family's measured costs (table {released['table']['name']}):")
    if "bound" in released:
        bound = released["bound"]
        cells = ", ".join(f"S({k + 1}) = {p:.2f}" for k, p in enumerate(bound["predicted"]))
        line += (f"\n  bound at {name}'s bytes ({costs_label(bound)}): {cells}; best k = {bound['best_k']}")
    return (line + f"\n  this run's drafter costs c = {measured_c:.3f} of its target's step, {name}'s "
            f"{released['c']:.3f}: a toy's S(k) cannot show what the drafter buys on the released model")


def plot_speedup(sp: dict[str, Any], path: str, title: str = "", released: dict[str, Any] | None = None) -> None:
    """S(k) with its 95% interval; with ``released`` (``released_speedup``), S(k) at the released
    model's costs beside it, each labelled with its costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(range(1, len(sp["predicted"]) + 1))
    pred, ci = sp["predicted"], sp["predicted_ci"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar(ks, pred,
                yerr=[[max(0.0, p - c[0]) for p, c in zip(pred, ci)], [max(0.0, c[1] - p) for p, c in zip(pred, ci)]],
                fmt="o-", capsize=3, label="S(k) predicted" if released is None else f"S(k), costs {sp['costs']}")
    if released is not None:
        rp, rci = released["predicted"], released["predicted_ci"]
        ax.errorbar(ks, rp, yerr=[[max(0.0, p - c[0]) for p, c in zip(rp, rci)],
                                  [max(0.0, c[1] - p) for p, c in zip(rp, rci)]],
                    fmt="s--", capsize=3, label=f"S(k) at {released['model']}'s costs ({released['costs']})")
        if "bound" in released:
            ax.plot(ks, released["bound"]["predicted"], "^:", color="0.4",
                    label=f"bound: {released['model']}'s bytes ({released['bound']['costs']}, memory-bound limit)")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.plot([sp["best_k"]], [pred[sp["best_k"] - 1]], "r*", ms=12, label=f"best k = {sp['best_k']}")
    ax.set_xlabel("k (drafts per step)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title or f"S(k) = τ(k) / (1 + k·{sp['c']:.2f} + v(k)), costs {sp['costs']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BYTES_SOURCES = {"bytes:glm5": "glm5", "bytes:glm5next": "glm5next"}
# The names the bytes costs had before cost tables: kept working, as the same memory-bound limit.
OLD_BYTES_NAMES = {"glm5": "glm5", "glm5next": "glm5next"}


def costs_kind(spec: Any) -> str:
    """What a ``speedup.costs`` names: ``measured``, ``bytes`` (``bytes:glm5``, ``bytes:glm5next``
    and their old names ``glm5``, ``glm5next``), ``table`` (a shipped cost table), ``file`` (an
    existing file: a cost table or a ``bench --target-costs`` costs.json); ``ValueError`` else."""
    if spec == "measured":
        return "measured"
    if spec in BYTES_SOURCES or spec in OLD_BYTES_NAMES:
        return "bytes"
    if isinstance(spec, str) and spec in cost_tables.shipped_names():
        return "table"
    if isinstance(spec, str) and os.path.isfile(spec):
        return "file"
    raise ValueError(f"speedup.costs must be measured, bytes:glm5, bytes:glm5next, a shipped cost table "
                     f"({', '.join(cost_tables.shipped_names())}; python -m glm_mtp.experiments.costs list) or the "
                     f"path of a cost table or costs.json, got {spec!r}")


def resolve_costs(spec: str, target: Any, proposer: Any, kmax: int, context: list[int],
                  repeats: int = 15) -> dict[str, Any]:
    """The costs an acceptance run predicts its speedup with (``costs_kind``): ``measured`` (timed
    here on its own target and drafter, ``measure_costs``); ``bytes:glm5`` / ``bytes:glm5next``
    (``preset_costs``, the memory-bound limit; ``glm5`` / ``glm5next`` the same); a shipped cost
    table's name or a cost table file (``cost_tables``: its first batch size's c and v, and
    ``per_batch`` when it has several; ``table`` its provenance; ``extrapolated`` the k beyond its
    widths); or a ``costs.json`` written by ``python -m glm_mtp.experiments.bench --target-costs``
    (its ``v`` must cover ``kmax``)."""
    kind = costs_kind(spec)
    if kind == "measured":
        return measure_costs(target, proposer, kmax, context, repeats)
    if kind == "bytes":
        return preset_costs(BYTES_SOURCES.get(spec) or OLD_BYTES_NAMES[spec], kmax)
    table = cost_tables.shipped_table(spec) if kind == "table" else read_costs_or_table(spec, kmax)
    if "c" in table:  # a bench --target-costs costs.json
        return {**table, "source": f"file:{spec}"}
    per_batch = cost_tables.per_batch_costs(table, kmax)
    first = per_batch[0]
    if kind == "file":
        first = {**first, "source": f"file:{spec}"}
        per_batch = [{**b, "source": f"file:{spec}"} for b in per_batch]
    return {**first, "per_batch": per_batch if len(per_batch) > 1 else None}


def check_costs_spec(spec: Any, kmax: int) -> None:
    """``speedup.costs`` before any work: its kind (``costs_kind``), and a file read and checked
    field by field (``read_costs_or_table``). ``ValueError`` naming the rule."""
    if costs_kind(spec) == "file":
        read_costs_or_table(spec, kmax)


def read_costs_or_table(path: str, kmax: int) -> dict[str, Any]:
    """A file of costs: a cost table (it has a ``format`` key; ``cost_tables.read_table``) or a
    ``bench --target-costs`` costs.json (``read_costs_file``)."""
    data = cost_tables.read_json(path)
    if isinstance(data, dict) and "format" in data:
        return cost_tables.check_table(data, path)
    return read_costs_file(path, kmax)


def read_costs_file(path: str, kmax: int) -> dict[str, Any]:
    """A ``costs.json`` (``bench --target-costs``): a JSON object with ``c`` a finite number >= 0
    and ``v`` a list of finite numbers covering ``k <= kmax``. ``ValueError`` naming the file and
    the rule (the acceptance run reads it before any work, then again for its summary)."""
    import math

    costs = cost_tables.read_json(path)

    def number(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x >= 0

    if not isinstance(costs, dict) or not number(costs.get("c")) or not isinstance(costs.get("v"), list) \
            or not all(number(x) for x in costs["v"]):
        raise ValueError(f"{path}: must hold a JSON object with c (a number >= 0) and v (a list of numbers >= 0), "
                         "as bench --target-costs writes, or a cost table (format glm-mtp-costs/1, docs/costs.md)")
    if len(costs["v"]) < kmax:
        raise ValueError(f"{path} holds v for k <= {len(costs['v'])}, fewer than num_drafts = {kmax}")
    return costs
