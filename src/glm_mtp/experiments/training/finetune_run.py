"""Fine-tune the MTP head from a trace (DESIGN.md §13): what ``python -m glm_mtp.experiments.finetune``
runs once its checks (``finetune_checks``) pass.

1. Load the drafter's tensors only (``finetune_io.input_tensors``): the MTP layer, the embedding
   and the head; never a target layer.
2. Train the MTP layer's tensors (fp32 master copies, fp8 weights dequantized; the embedding, the
   head and the routing bias frozen) with AdamW on the training prompts' items: the loss is the
   mean over depths ``d = 1 .. finetune.depth`` of the cross-entropy of the drafter's depth-d
   logits (``mtp_train_forward.drafter_forward``, torch's kernels) against the target's own next
   token ``argmax[p + d]`` (self-distillation). Each step draws ``batch_size`` training items
   from a generator seeded with ``finetune.seed``; torch runs ``finetune.threads`` threads: the
   same trace, seed and thread count give the same bytes. Under ``torchrun`` (``WORLD_SIZE`` > 1)
   each rank backpropagates its share of the step's items and the gradients are summed over
   ranks (``finetune_dist``: data parallel, gloo); only rank 0 goes on to 3 and 4. Every
   ``finetune.eval_every`` steps (and at the end) rank 0 records the held-out loss and replays
   the held-out prompts with the head of that step (written to a temporary directory in the
   output's layout and read back, as 4 reads the final one): ``summary.json``'s
   ``replay.history``.
3. Write the tuned checkpoint in the input's layout (``finetune_io``), its model card, the loss
   and replay curves and ``summary.json``.
4. Judge it by replay (``finetune_judge``): the held-out prompts, base head against the written
   tuned head (read back by ``MtpWeights.from_pretrained``), paired; the same for each
   ``finetune.eval_traces`` trace (all its prompts).

Before 1, ``prepare`` does everything that can refuse the run: the trace (and each eval trace)
checked shard by shard (``traces.shard_reader``: the items are then read from their shards on
demand, a step's batch or one held-out prompt at a time, never the whole trace), the input's
tensors read, the ranks' agreement, and ``finetune_agree``'s check that the training forward is
the reference drafter's on a training item. A ``ValueError`` there is a refusal: the entry point
prints it as one line and exits 2, nothing written.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import MtpWeights

from ..reporting.kept import write_json, write_text
from ..traces.shard_reader import TraceItems, open_items
from . import finetune_dist as dp
from .finetune_agree import check_forward_agrees
from .finetune_io import input_tensors, master_copies, tuned_tensors, write_checkpoint
from .finetune_split import PromptSplit
from .mtp_train_forward import VENDOR, drafter_forward


# The run folder's record of the training's losses, written before the checkpoint and the judging.
LOSS_FILE = "finetune_loss.json"


def weights_of(cfg: MtpConfig, stored: dict[str, Tensor], masters: dict[str, Tensor]) -> MtpWeights:
    """fp32 ``MtpWeights`` whose trainable tensors are ``masters`` (so gradients reach them), the
    rest ``stored`` cast to fp32 (the routing bias and glm5_next's router stay fp32). Built anew
    each step: stacking the experts is part of the graph."""
    from glm_mtp.reference import fp8

    prefix = cfg.layer_prefix
    layer: dict[str, Tensor] = {}
    for name, t in stored.items():
        if name.startswith(prefix) and not name.endswith(fp8.SCALE_SUFFIX):
            rel = name[len(prefix):]
            if name in masters:
                layer[rel] = masters[name]
            elif t.dtype == fp8.FP8_DTYPE:
                layer[rel] = fp8.dequantize(fp8.BlockScaledWeight(t, stored[fp8.scale_name(name)]), torch.float32)
            else:
                layer[rel] = t.to(torch.float32)
    return MtpWeights.from_tensors(cfg, layer, stored[cfg.embed_tokens_name].to(torch.float32),
                                   stored["lm_head.weight"].to(torch.float32))


def item_loss(w: MtpWeights, item: Any, depth: int, feed_hidden: str) -> tuple[Tensor, int]:
    """Mean cross-entropy over an item's depth-d rows against ``argmax[p + d]``, averaged over
    depths; and the rows scored."""
    tokens = item.tokens.long()
    L = tokens.shape[0]
    d_max = min(depth, L - 1)
    outs = drafter_forward(w, tokens, item.hidden.to(torch.float32), d_max, ops=VENDOR, feed_hidden=feed_hidden)
    losses, rows = [], 0
    for d, out in enumerate(outs, start=1):
        labels = item.argmax[d : d + out.logits.shape[0]].long()  # the target's next token after t_{p+d}
        losses.append(F.cross_entropy(out.logits, labels))
        rows += labels.shape[0]
    return torch.stack(losses).mean(), rows


@torch.no_grad()
def mean_loss(w: MtpWeights, trace: TraceItems, items: list[int], depth: int, feed_hidden: str) -> float:
    """The mean ``item_loss`` of the trace's ``items``, read one at a time."""
    return sum(float(item_loss(w, trace.item(i), depth, feed_hidden)[0]) for i in items) / len(items)


def plot_losses(loss: list[dict[str, Any]], path: str, history: list[dict[str, Any]] | None = None,
                base_tau: float | None = None) -> None:
    """Train and held-out loss against steps and, given the replay ``history`` (and the base
    head's tau), the held-out replay's tau of each eval step beside them: one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if history else 1, figsize=(11 if history else 6, 3.5), squeeze=False)
    ax = axes[0][0]
    steps = [r["step"] for r in loss]
    ax.plot(steps, [r["train"] for r in loss], "o-", label="train (the step's batch)")
    ax.plot(steps, [r["heldout"] for r in loss], "s-", label="held-out prompts")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy vs the target's argmax (nats)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    if history:
        ax = axes[0][1]
        ax.plot([r["step"] for r in history], [r["tuned"]["tau"] for r in history], "o-", label="tuned head")
        if base_tau is not None:
            ax.axhline(base_tau, color="gray", linestyle="--", label="base head")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out replay tau")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


ReplayAt = Callable[[int, dict[str, Tensor]], dict[str, Any]]  # (step, masters) -> a replay history entry


def train(cfg: Any, model_cfg: MtpConfig, stored: dict[str, Tensor], trace: TraceItems, split: PromptSplit,
          log: Any, rank: int = 0, world: int = 1, replay_at: ReplayAt | None = None
          ) -> tuple[dict[str, Tensor], list[dict[str, Any]], int, bool, list[dict[str, Any]]]:
    """The training loop (module docstring, 2): the masters, the loss records, steps run,
    whether ``finetune.max_minutes`` stopped it early and the replay history. ``rank`` of
    ``world`` data-parallel ranks (``finetune_dist``; a joined process group when ``world`` > 1):
    this rank trains on its share of each step's batch, each item read from its shard when drawn;
    the held-out loss, the records and the bar are rank 0's. ``replay_at``: called by rank 0 at
    every eval step but the last (whose replay is the final judge's, of the written checkpoint),
    its entries returned in step order."""
    from tqdm import tqdm

    f = cfg.finetune
    masters = master_copies(stored, model_cfg.layer_prefix, tuple(f.get("trainable") or ()))
    params = list(masters.values())
    opt = torch.optim.AdamW(params, lr=f.lr, betas=(0.9, 0.95), weight_decay=f.weight_decay)
    train_items, held_items = split.train_items, split.heldout_items  # trace indices, read when used
    gen = torch.Generator().manual_seed(f.seed)
    deadline = time.perf_counter() + 60 * f.max_minutes
    records: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    bar = tqdm(range(f.steps), desc="finetune", dynamic_ncols=True, mininterval=2, disable=rank != 0)
    step, stopped = 0, False
    for step in bar:
        # Every rank draws the whole batch from the same generator, then takes its share.
        pick = torch.randint(0, len(train_items), (f.batch_size,), generator=gen).tolist()
        w = weights_of(model_cfg, stored, masters)
        opt.zero_grad(set_to_none=True)
        mine = dp.share(pick, rank, world)
        local = torch.stack([item_loss(w, trace.item(train_items[i]), f.depth, f.feed_hidden)[0] for i in mine]).sum()
        (local / f.batch_size).backward()  # this rank's part of the global batch's mean
        dp.sum_gradients(params, world)  # the global mean's gradient on every rank
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, f.grad_clip))
        opt.step()
        train_loss = dp.sum_over_ranks(float(local.detach()), world) / f.batch_size
        bar.set_postfix(loss=f"{train_loss:.3f}")
        log.log({"train/loss": train_loss, "train/grad_norm": gnorm}, step=step)
        last = step == f.steps - 1 or dp.rank0_says(time.perf_counter() >= deadline, world)
        if rank == 0 and (step % f.eval_every == 0 or last):
            held = mean_loss(weights_of(model_cfg, stored, masters), trace, held_items, f.depth, f.feed_hidden)
            records.append({"step": step, "train": train_loss, "heldout": held})
            log.log({"heldout/loss": held}, step=step)
            said = ""
            if replay_at is not None and not last:
                history.append(replay_at(step, masters))
                log.log({"heldout/tuned_tau": history[-1]["tuned"]["tau"]}, step=step)
                said = f", held-out replay tau {history[-1]['tuned']['tau']:.3f}"
            tqdm.write(f"step {step}: train {train_loss:.4f} held-out {held:.4f}{said}")
        if last:
            stopped = step < f.steps - 1
            break
    bar.close()
    return masters, records, step + 1, stopped, history


def model_card(cfg: Any, trace: TraceItems, split: PromptSplit, steps: int, stopped: bool, loss: list[dict[str, Any]],
               replay: dict[str, Any], command: str, model_dir: str, world: int = 1) -> str:
    """The tuned checkpoint's README.md (``world``: the data-parallel ranks that trained it)."""
    f = cfg.finetune
    b, t, d = replay["base"], replay["tuned"], replay["delta"]
    alphas = " / ".join(f"{a:.3f}" for a in t["alpha"])
    base_alphas = " / ".join(f"{a:.3f}" for a in b["alpha"])
    lines = [
        "# MTP head fine-tuned from a trace (DESIGN.md §13)", "",
        f"Base: `{model_dir}`. Only the MTP layer's tensors changed; the embedding and the head are the base's bytes.",
        "", "## Command", "", "```", command, "```", "",
        f"- trace: `{trace.path}`, trace.json sha256 `{trace.sha256}`",
        f"- split by prompt (seed {f.seed}, held-out share {f.heldout}): {len(split.train_prompts)} training prompts "
        f"({len(split.train_items)} items), {len(split.heldout_prompts)} held out ({len(split.heldout_items)} items), "
        "listed in summary.json; never trained on",
        f"- {steps} AdamW steps{' (stopped by finetune.max_minutes)' if stopped else ''}: lr {f.lr}, batch "
        f"{f.batch_size} items, depth {f.depth} (shared weights), weight decay {f.weight_decay}, clip {f.grad_clip}, "
        f"seed {f.seed}, {f.threads} thread(s), {world} data-parallel rank(s), labels: the target's argmax",
        f"- loss (train, held-out) at the first and last eval: {loss[0]['train']:.4f}, {loss[0]['heldout']:.4f} -> "
        f"{loss[-1]['train']:.4f}, {loss[-1]['heldout']:.4f}",
        "", f"## Held-out replay (k = {replay['num_drafts']}, greedy, {replay['prompts']} prompts)", "",
        "| head | tau | alpha_1.. |", "|---|---|---|",
        f"| base | {b['tau']:.3f} | {base_alphas} |", f"| tuned | {t['tau']:.3f} | {alphas} |", "",
        f"delta tau {d['tau'][0]:+.3f} [{d['tau'][1]:+.3f}, {d['tau'][2]:+.3f}] (paired bootstrap 95% over prompts).",
        "", "Tuned tau at each eval step (summary.json's replay.history): "
        + ", ".join(f"step {r['step']}: {r['tuned']['tau']:.3f}" for r in replay["history"]) + ".",
        "", "Same trace, seed, thread count and rank count: byte-identical tensors.", ""]
    return "\n".join(lines)


Checked = tuple[str, MtpConfig, dict[str, Any], PromptSplit]  # finetune_checks.check_finetune's


@dataclass
class Prepared:
    """What ``prepare`` read and checked: the data-parallel rank and world (and whether
    ``prepare`` joined the process group), the trace and eval traces (read on demand), the input's
    tensors as stored and the file of each, and when the run started (``time.perf_counter``)."""

    rank: int
    world: int
    started: bool
    trace: TraceItems
    eval_traces: list[TraceItems]
    stored: dict[str, Tensor]
    files: dict[str, str]
    t0: float


def prepare(cfg: Any, checked: Checked) -> Prepared:
    """Everything before training that can refuse the run (module docstring), writing nothing:
    a ``ValueError`` names what is wrong (``TraceError``, ``CheckpointError``,
    ``finetune_agree.ForwardDisagreement``)."""
    from omegaconf import OmegaConf

    model_dir, model_cfg, _, split = checked
    f = cfg.finetune
    rank, world = dp.world_from_env()
    started = dp.start(world)
    torch.set_num_threads(f.threads)
    torch.manual_seed(f.seed)
    import logging

    logging.getLogger("glm_mtp").setLevel(logging.WARNING)  # the drafter logs every prefill at INFO
    t0 = time.perf_counter()
    trace = open_items(cfg.trace.path)
    evals = [open_items(path) for path in f.get("eval_traces") or []]
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)  # the composed config is a mapping
    # The ranks must train on the same items with the same draws: refuse before any work if not.
    dp.check_agree("the trace, the split and finetune.*", (trace.sha256, split.record(), config["finetune"]), world)
    stored, files = input_tensors(model_dir)
    if world > 1:  # hashing the tensors costs a pass over them: only where there is another rank to agree with
        dp.check_agree("the input checkpoint's tensors (sha256)", dp.digest(stored), world)
    first = split.train_items[0]
    check_forward_agrees(weights_of(model_cfg, stored, {}), trace.item(first), first, f.depth, f.feed_hidden)
    return Prepared(rank, world, started, trace, evals, stored, files, t0)


def tuned_weights(model_dir: str, stored: dict[str, Tensor], masters: dict[str, Tensor], files: dict[str, str],
                  dtype: torch.dtype, share: Any) -> MtpWeights:
    """The head ``masters`` make, as the replay reads it: written in the output's layout
    (``finetune_io``) to a temporary directory and read back by ``MtpWeights.from_pretrained``,
    exactly as the final checkpoint is."""
    with tempfile.TemporaryDirectory(prefix="finetune-eval-") as tmp:
        write_checkpoint(model_dir, tmp, tuned_tensors(stored, masters), files)
        return MtpWeights.from_pretrained(tmp, dtype=dtype).with_index_share(share)


def run(cfg: Any, run_dir: str, checked: Checked, command: str, prepared: Prepared | None = None
        ) -> dict[str, Any] | None:
    """Fine-tune, write and judge (module docstring); returns summary.json's record, or
    ``None`` on a data-parallel rank other than 0 (which writes nothing). ``prepared``:
    ``prepare``'s (None: prepared here)."""
    from omegaconf import OmegaConf

    from glm_mtp.registry import parse_dtype

    from ..reporting.wandb_log import NoLogger, make_logger
    from .finetune_judge import head_stats, judge, judge_counts, paired_delta, replay_counts

    model_dir, model_cfg, _, split = checked
    f, mcfg = cfg.finetune, cfg.model
    p = prepared or prepare(cfg, checked)
    rank, world, trace, stored, files = p.rank, p.world, p.trace, p.stored, p.files
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)  # the composed config is a mapping
    dtype = parse_dtype(mcfg.dtype)
    share = mcfg.get("index_share")
    max_seq_len = min(mcfg.max_seq_len, model_cfg.max_position_embeddings)
    held = split.heldout_items
    base_counts: dict[str, Any] = {}  # the base head's held-out replay, once, at the first eval

    def base_replay() -> dict[str, Any]:
        if not base_counts:
            base = MtpWeights.from_pretrained(model_dir, dtype=dtype).with_index_share(share)
            base_counts.update(replay_counts(trace, held, base, f.num_drafts, max_seq_len, f.feed_hidden, f.seed))
        return base_counts

    def replay_at(step: int, masters: dict[str, Tensor]) -> dict[str, Any]:
        cb = base_replay()
        tuned = tuned_weights(model_dir, stored, masters, files, dtype, share)
        ct = replay_counts(trace, held, tuned, f.num_drafts, max_seq_len, f.feed_hidden, f.seed)
        return {"step": step, "tuned": head_stats(ct), "delta": paired_delta(ct, cb, f.seed)}

    if rank == 0:
        os.makedirs(f.out, exist_ok=True)
        os.makedirs(run_dir, exist_ok=True)
        log = make_logger(cfg.logger, run_dir, cast(dict[str, Any], config), job_type="finetune",
                          group=cfg.get("group"))
    else:
        log = NoLogger()
    masters, loss, steps, stopped, history = train(cfg, model_cfg, stored, trace, split, log, rank, world,
                                                   replay_at if rank == 0 else None)
    if world > 1:
        dp.check_agree("the tuned masters (sha256)", dp.digest(masters), world)
    dp.finish(p.started)
    if rank != 0:
        return None
    write_json(os.path.join(run_dir, LOSS_FILE), {"steps": steps, "stopped_early": stopped, "loss": loss})  # kept
    write_checkpoint(model_dir, f.out, tuned_tensors(stored, masters), files)
    train_minutes = (time.perf_counter() - p.t0) / 60

    base = MtpWeights.from_pretrained(model_dir, dtype=dtype).with_index_share(share)
    tuned = MtpWeights.from_pretrained(f.out, dtype=dtype).with_index_share(share)
    cb = base_replay()
    ct = replay_counts(trace, held, tuned, f.num_drafts, max_seq_len, f.feed_hidden, f.seed)
    replay = judge_counts(trace, held, cb, ct, f.num_drafts, f.seed)
    history.append({"step": loss[-1]["step"], "tuned": replay["tuned"], "delta": replay["delta"]})
    replay["history"] = history  # the held-out replay of every eval step, the last the written checkpoint's
    evals = []
    for path, extra in zip(f.get("eval_traces") or [], p.eval_traces):
        evals.append({"path": path, **judge(extra, list(range(len(extra))), base, tuned, f.num_drafts,
                                            max_seq_len, f.feed_hidden, f.seed)})
    summary = {"command": command, "model": model_dir, "out": f.out, "trace": trace.record(),
               "split": split.record(), "steps": steps, "stopped_early": stopped,
               "settings": OmegaConf.to_container(f, resolve=True), "loss": loss, "replay": replay,
               "eval_traces": evals, "train_minutes": train_minutes, "world_size": world}
    png = os.path.join(f.out, "loss_curve.png")
    plot_losses(loss, png, history, replay["base"]["tau"])
    log.log_image("loss_curve", png)
    log.summary({"replay/delta_tau": replay["delta"]["tau"][0], "replay/base_tau": replay["base"]["tau"],
                 "replay/tuned_tau": replay["tuned"]["tau"]})
    log.finish()
    write_text(os.path.join(f.out, "README.md"),
               model_card(cfg, trace, split, steps, stopped, loss, replay, command, model_dir, world))
    write_json(os.path.join(f.out, "summary.json"), summary)  # last, whole or not at all (reporting.kept)
    b, t, d = replay["base"], replay["tuned"], replay["delta"]
    print(f"held-out replay (k={f.num_drafts}, {replay['prompts']} prompts): tau {b['tau']:.3f} -> {t['tau']:.3f}, "
          f"delta {d['tau'][0]:+.3f} [{d['tau'][1]:+.3f}, {d['tau'][2]:+.3f}]; checkpoint in {f.out}")
    return summary


def run_keeping(cfg: Any, run_dir: str, checked: Checked, command: str, prepared: Prepared | None = None
                ) -> dict[str, Any] | None:
    """``run``, with a failure after the training as one ``LateFailure`` naming what it kept: the
    losses (``<run_dir>/finetune_loss.json``) and the tuned checkpoint in ``finetune.out`` (its
    ``summary.json``, written last, is there only when the run finished)."""
    from ..reporting.kept import late_failure

    try:
        return run(cfg, run_dir, checked, command, prepared)
    except Exception as e:
        losses = os.path.join(run_dir, LOSS_FILE)
        if not os.path.exists(losses):  # failed before it trained: nothing measured
            raise
        raise late_failure("the fine-tuning run, after its training", e, [losses, cfg.finetune.out]) from e
