"""The exact one-step check of DESIGN.md §14: at a fixed context, both verifications accept an
argmax draft ``d_1`` with probability ``p(d_1)``.

``rejection`` accepts a one-hot draft when ``u < p(d_1)`` (``u`` uniform from the run's generator);
``match`` accepts it when the target's seeded sample at that position equals it, and the seeded
sampler's exponential race draws token j with probability ``w_j``, the pinned softmax of the kept
tokens. So over many seeds, at one context, each rule's acceptance frequency of ``d_1`` estimates
the same ``p(d_1)``, which the target's logits give exactly.

A **context** is a held-out window ``x_0 .. x_n`` of the checkpoint's own text: the target
prefills ``x_0 .. x_{n-1}``, the drafter prefills those rows, ``t_m = x_n`` (m = n) is the newest
token, the drafter's ``propose(t_m, h_{m-1}, m - 1, 1)`` gives ``d_1`` and the target's verify of
``[t_m, d_1]`` gives the logits (2, V) at positions m, m + 1, as in one round of the loop
(``experiments.loop.round.play_round``). Then, for each seed s, ONE call of the package's
``verify(rule, ...)`` per rule, with what the round would give it:

- ``rejection``: ``torch.Generator().manual_seed(s)`` and, with top_p / top_k, the sampler's kept
  set as ``allowed`` (``RoundRules.support``);
- ``match``: the target's seeded samples of the two rows, keyed by seed s, the prompt's sha256 and
  the positions m, m + 1 (``match_verify.target_samples``).

The report gives, per context, ``p(d_1)`` exact (the sampler's pinned ``w``, and rejection's
float64 softmax over the same kept set beside it) and each rule's acceptance count with its Wilson
95% interval.

    python -m glm_mtp.tools.one_step --model next_shipped --contexts 4 --seeds 2000 --out next.json
    python -m glm_mtp.tools.one_step --model shipped --top-p 0.95 --out glm5-p0.95.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

import torch
from torch import Tensor

from glm_mtp.ranges import ranged_int
from glm_mtp.reference.numerics import masked_softmax, up

from ..experiments.loop.grammar_verify import masked_target_probs
from ..experiments.loop.match_verify import target_samples
from ..experiments.loop.sampler import SamplerSettings, kept_tokens, truncates
from ..experiments.loop.verify import target_probs, verify
from ..experiments.traces.prompt_id import prompt_sha256

RULES = ("rejection", "match")
MODELS = {"next_shipped": "glm5next-mtp-stdlib", "shipped": "glm5-mtp-stdlib"}
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class Context:
    """One fixed context: the verify's output there and the draft.

    Args:
        prompt: ``x_0 .. x_{n-1}``, the prompt the match rule's samples are keyed by.
        position: m = n, the position of ``t_m``, the verify's first row.
        logits: (2, V) the target's logits of the verify ``[t_m, d_1]``.
        draft: d_1, the drafter's argmax after ``t_m``.
    """

    prompt: list[int]
    position: int
    logits: Tensor
    draft: int

    @property
    def sha256(self) -> str:
        return prompt_sha256(self.prompt)


class _Verified:
    """What a target's verify returns, as ``target_samples`` reads it: ``logits`` only (no
    recorded ``sample``, so the seeded samples are drawn from the logits)."""

    def __init__(self, logits: Tensor) -> None:
        self.logits = logits


def fixed_context(target: Any, proposer: Any, window: list[int]) -> Context:
    """The context of ``window`` (``x_0 .. x_n``, n >= 1; module docstring): the target's and
    the drafter's prefill of ``x_0 .. x_{n-1}``, the propose of one draft after ``t_m = x_n`` and
    the target's verify of ``[t_m, d_1]``."""
    if len(window) < 2:
        raise ValueError(f"a context window needs at least 2 tokens (a prompt and t_m), got {len(window)}")
    prompt, token, m = list(window[:-1]), int(window[-1]), len(window) - 1
    tstate = target.alloc_state()
    out = target.prefill(prompt, tstate)  # h_0 .. h_{m-1}
    dstate = proposer.alloc_state("cpu")
    try:
        proposer.prefill_drafter(prompt, out.hidden, dstate)  # rows [0, m-1)
        drafts = proposer.propose(token, out.hidden[-1:], m - 1, 1, dstate)
        proposer.after_verify(0, dstate)
    finally:
        proposer.free_state(dstate)
    verified = target.verify([token, int(drafts[0])], tstate)  # positions m, m + 1
    return Context(prompt, m, verified.logits[:2].detach().clone(), int(drafts[0]))


def exact_acceptance(ctx: Context, settings: SamplerSettings) -> dict[str, float]:
    """``p(d_1)`` at the context, exactly: ``pinned`` the sampler's ``w`` (the pinned softmax of
    ``logits / T`` over the kept set, what the race draws by) and ``float64`` rejection's
    ``softmax(logits / T)`` in float64 over the same kept set (what ``u`` is compared with)."""
    row = ctx.logits[:1]  # (1, V)
    kept = kept_tokens(row, settings)  # (1, V)
    s = up(row) / torch.tensor(settings.temperature, dtype=up(row).dtype)
    w = masked_softmax(s, kept)[0]  # (V,)
    if truncates(settings):
        p64 = masked_target_probs(row, settings.temperature, kept)[0]
    else:
        p64 = target_probs(row, settings.temperature)[0]
    return {"pinned": float(w[ctx.draft]), "float64": float(p64[ctx.draft])}


def support(ctx: Context, settings: SamplerSettings) -> Tensor | None:
    """(2, V) bool, the sampler's kept set at the verify's rows (``RoundRules.support``: what
    ``rejection`` takes as ``allowed`` under top_p / top_k; None without truncation). It reads the
    logits only, not the seed."""
    return kept_tokens(ctx.logits, settings) if truncates(settings) else None


def accepted_once(rule: str, ctx: Context, settings: SamplerSettings, seed: int,
                  samples_of: Callable[..., list[int]] = target_samples, allowed: Tensor | None = None) -> bool:
    """Whether ONE verify of ``[t_m, d_1]`` by ``rule`` at ``seed`` accepts ``d_1``: the package's
    ``verify`` with what the round gives it (module docstring). ``samples_of``: how ``match``'s
    samples are drawn (the round's ``target_samples``; a test swaps in a broken one);
    ``allowed``: ``support(ctx, settings)``, computed once per context (None: computed here)."""
    run = SamplerSettings(settings.temperature, settings.top_p, settings.top_k, seed)
    gen = torch.Generator().manual_seed(seed)
    if rule == "match":
        samples = samples_of(_Verified(ctx.logits), run, ctx.sha256, ctx.position, 2)
        accepted, _ = verify("match", ctx.logits, [ctx.draft], run.temperature, gen, samples=samples)
    elif rule == "rejection":
        if allowed is None:
            allowed = support(ctx, run)
        accepted, _ = verify("rejection", ctx.logits, [ctx.draft], run.temperature, gen, allowed=allowed)
    else:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    return accepted == 1


def acceptance_counts(ctx: Context, settings: SamplerSettings, seeds: Sequence[int],
                      samples_of: Callable[..., list[int]] = target_samples) -> dict[str, int]:
    """Per rule, how many of ``seeds`` accepted ``d_1`` (``accepted_once``)."""
    allowed = support(ctx, settings)
    return {rule: sum(accepted_once(rule, ctx, settings, s, samples_of, allowed) for s in seeds) for rule in RULES}


def wilson(accepted: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``accepted / trials`` (95% at the default
    ``z``): ``(c - h, c + h) / (1 + z^2 / n)``, ``c = phat + z^2 / 2n``, ``h = z sqrt(phat (1 - phat)
    / n + z^2 / 4n^2)``. It keeps its coverage near 0 and 1, where the normal interval does not."""
    if not 0 <= accepted <= trials or trials < 1:
        raise ValueError(f"need 0 <= accepted <= trials and trials >= 1, got {accepted} of {trials}")
    n, phat = trials, accepted / trials
    denom = 1 + z * z / n
    centre = phat + z * z / (2 * n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))
    return (centre - half) / denom, (centre + half) / denom


def check_one(ctx: Context, settings: SamplerSettings, seeds: Sequence[int]) -> dict[str, Any]:
    """One context's row: ``p(d_1)`` exact, and per rule the count, the frequency, its Wilson 95%
    interval and whether the interval holds the exact ``p(d_1)``."""
    exact = exact_acceptance(ctx, settings)
    counts = acceptance_counts(ctx, settings, seeds)
    n = len(seeds)
    rules = {}
    for rule, k in counts.items():
        lo, hi = wilson(k, n)
        rules[rule] = {"accepted": k, "trials": n, "frequency": k / n, "wilson95": [lo, hi],
                       "holds_p": lo <= exact["pinned"] <= hi}
    argmax = int(torch.argmax(ctx.logits[0]))
    return {"prompt_sha256": ctx.sha256, "position": ctx.position, "draft": ctx.draft,
            "draft_is_target_argmax": ctx.draft == argmax, "p_d1": exact, "rules": rules}


def load(model: str, numerics: str) -> tuple[Any, Any, Any]:
    """The shipped checkpoint ``model`` (a key of ``MODELS``) in float32: the loaded model, its
    target (``numerics``) and the reference drafter."""
    from ..experiments.loop.speculative import make_proposer
    from ..experiments.targets.checkpoint import load_checkpoint, shipped_checkpoint
    from ..experiments.targets.target import Target

    loaded = load_checkpoint(shipped_checkpoint(MODELS[model]), torch.float32)
    if loaded.target is None:
        raise ValueError(f"{MODELS[model]}: the checkpoint holds no target")
    max_seq_len = loaded.mtp.config.max_position_embeddings
    return loaded, Target(loaded.target, max_seq_len, numerics=numerics), make_proposer("reference", loaded.mtp,
                                                                                       max_seq_len)


def format_table(record: dict[str, Any]) -> str:
    """The record as a Markdown table: one row per context and rule."""
    lines = ["| context | d_1 (target argmax?) | p(d_1) exact | rule | accepted / seeds | frequency [Wilson 95%] "
             "| holds p(d_1) |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(record["contexts"]):
        for rule, r in row["rules"].items():
            lo, hi = r["wilson95"]
            lines.append(f"| {i} | {row['draft']} ({'yes' if row['draft_is_target_argmax'] else 'no'}) | "
                         f"{row['p_d1']['pinned']:.4f} | {rule} | {r['accepted']} / {r['trials']} | "
                         f"{r['frequency']:.4f} [{lo:.4f}, {hi:.4f}] | {'yes' if r['holds_p'] else 'no'} |")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _unit_float(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (math.isfinite(x) and 0 < x <= 1) if name == "top_p" else not (math.isfinite(x) and x > 0):
            raise argparse.ArgumentTypeError(f"{name} must be {'in (0, 1]' if name == 'top_p' else '> 0'}, got {x}")
        return x

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog="python -m glm_mtp.tools.one_step",
                description="p(d_1) exact against both verifications' acceptance frequency at fixed contexts")
    p.add_argument("--model", default="next_shipped", choices=list(MODELS))
    p.add_argument("--contexts", type=ranged_int(1, 1024), default=4, help="held-out windows (default 4)")
    p.add_argument("--context-tokens", type=ranged_int(2, 512), default=48,
                   help="tokens per window: the prompt and t_m (default 48)")
    p.add_argument("--seeds", type=ranged_int(1, 10**7), default=2000, help="seeds 0 .. N-1 per context (default 2000)")
    p.add_argument("--temperature", type=_unit_float("temperature"), default=1.0)
    p.add_argument("--top-p", type=_unit_float("top_p"), default=None, help="the sampler's top_p (default off)")
    p.add_argument("--target-numerics", default="pinned", choices=["pinned", "vendor"])
    p.add_argument("--threads", type=ranged_int(1, 256), default=1)
    p.add_argument("--out", default=None, help="write the record here as JSON (a new file; the table beside it as .md)")
    a = p.parse_args(argv)
    if a.out is not None:
        if os.path.exists(a.out):
            p.error(f"--out {a.out}: exists (not overwritten)")
        parent = os.path.dirname(os.path.abspath(a.out))
        if not os.path.isdir(parent):
            p.error(f"--out {a.out}: its folder {parent} does not exist")
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    from ..experiments.settings.windows import build_prompts

    loaded, target, proposer = load(a.model, a.target_numerics)
    settings = SamplerSettings(a.temperature, a.top_p, None, 0)
    windows = build_prompts(loaded, a.contexts, a.context_tokens, 0, "heldout")
    seeds = range(a.seeds)
    rows = [check_one(fixed_context(target, proposer, w), settings, seeds) for w in windows]
    record = {"model": a.model, "checkpoint": MODELS[a.model], "target_numerics": a.target_numerics,
              "temperature": a.temperature, "top_p": a.top_p, "context_tokens": a.context_tokens,
              "seeds": a.seeds, "source": "heldout", "contexts": rows, "wall_seconds": time.perf_counter() - t0}
    table = format_table(record)
    print(table)
    print(f"{sum(r['holds_p'] for row in rows for r in row['rules'].values())} of {2 * len(rows)} intervals hold "
          f"p(d_1); {record['wall_seconds']:.0f}s")
    if a.out is not None:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
