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

Costs come from two places:

- ``measure_costs``: timed on this machine for a given target and drafter (the toy target of the
  experiments), medians of alternating repeats (``experiments/bench.py --target-costs`` writes
  them to ``costs.json``; the acceptance run measures them for its own target and drafter);
- ``bytes_costs``: from the bytes each step must read (weights only, memory-bound), for a
  released model (``preset_costs``: GLM-5, or GLM-5.3-Flash for the glm5_next family); for GLM-5:
  a draft step reads one MTP layer (attention, router, shared expert, 8 routed experts) + the
  head; a target step reads 78 layers (3 dense) + the head; a verify of n tokens reads, per MoE
  layer, the experts the n tokens choose: ``E * (1 - (1 - topk / E)^n)`` of them when routing is
  uniform and independent (real routing is correlated, so this is an upper bound on v).

Intervals: the bootstrap over prompts of ``stats.py`` applied to tau(k); c and v are taken as
fixed (their spread over repeats is recorded beside them).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from glm_mtp.reference.config import MtpConfig
from glm_mtp.tools.floor import floor_bytes_per_draft

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


def released_speedup(counts_per_prompt: dict[str, Any], family: str, kmax: int, seed: int = 0) -> dict[str, Any]:
    """``speedup_summary`` of these acceptance counts at the costs of the released model of the
    drafter's ``family`` (``RELEASED``: from the bytes each step reads), with ``model`` (its name)
    and ``preset``: what the measured drafter buys on the real model.

    Args:
        counts_per_prompt: the run's ``reached``, ``accepted`` and ``steps`` per prompt.
        family: the drafter's ``MtpConfig.family``.
        kmax: the run's num_drafts (v(k) for k <= kmax).
        seed: the bootstrap's seed (the run's).
    """
    preset, name = RELEASED[family]
    costs = preset_costs(preset, kmax)
    return {**speedup_summary(counts_per_prompt, costs["c"], costs["v"], seed=seed, source=costs["source"]),
            "model": name, "preset": preset}


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


def format_line(sp: dict[str, Any], label: str = "predicted speedup") -> str:
    """``<label> S(1) = 1.23 [1.1, 1.3], ...; best k = 2 (c = 0.31, v = ..., costs ...)``."""
    cells = ", ".join(f"S({k + 1}) = {p:.2f} [{ci[0]:.2f}, "
                      f"{ci[1]:.2f}]" for k, (p, ci) in enumerate(zip(sp["predicted"], sp["predicted_ci"])))
    v = ", ".join(f"{x:.2f}" for x in sp["v"])
    return f"{label} {cells}; best k = {sp['best_k']} (c = {sp['c']:.3f}, v = [{v}], costs {sp['costs']})"


def released_line(released: dict[str, Any], measured_c: float) -> str:
    """The line beside this run's S(k): the same acceptance at the released model's costs, and why
    the two differ (the drafter's cost c relative to its target's decode step)."""
    return (format_line(released, f"at {released['model']}'s costs (the bytes each step reads):") + "; this run's "
            f"drafter costs c = {measured_c:.3f} of its target's step, {released['model']}'s "
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


COST_SOURCES = ("measured", "glm5", "glm5next")


def resolve_costs(spec: str, target: Any, proposer: Any, kmax: int, context: list[int],
                  repeats: int = 15) -> dict[str, Any]:
    """The costs an acceptance run predicts its speedup with: ``measured`` (timed here on its own
    target and drafter, ``measure_costs``), ``glm5`` or ``glm5next`` (``preset_costs``: GLM-5's or
    GLM-5.3-Flash's from bytes), or the path of a
    ``costs.json`` written by ``python -m glm_mtp.experiments.bench --target-costs`` (its ``v``
    must cover ``kmax``)."""
    if spec == "measured":
        return measure_costs(target, proposer, kmax, context, repeats)
    if spec in ("glm5", "glm5next"):
        return preset_costs(spec, kmax)
    return {**read_costs_file(spec, kmax), "source": f"file:{spec}"}


def read_costs_file(path: str, kmax: int) -> dict[str, Any]:
    """A ``costs.json`` (``bench --target-costs``): a JSON object with ``c`` a finite number >= 0
    and ``v`` a list of finite numbers covering ``k <= kmax``. ``ValueError`` naming the file and
    the rule (the acceptance run reads it before any work, then again for its summary)."""
    import json
    import math

    try:
        with open(path) as f:
            costs = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None

    def number(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x >= 0

    if not isinstance(costs, dict) or not number(costs.get("c")) or not isinstance(costs.get("v"), list) \
            or not all(number(x) for x in costs["v"]):
        raise ValueError(f"{path}: must hold a JSON object with c (a number >= 0) and v (a list of numbers >= 0), "
                         "as bench --target-costs writes")
    if len(costs["v"]) < kmax:
        raise ValueError(f"{path} holds v for k <= {len(costs['v'])}, fewer than num_drafts = {kmax}")
    return costs
