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
   ranks (``finetune_dist``: data parallel, gloo); only rank 0 goes on to 3 and 4.
3. Write the tuned checkpoint in the input's layout (``finetune_io``), its model card, the loss
   curve and ``summary.json``.
4. Judge it by replay (``finetune_judge``): the held-out prompts, base head against the written
   tuned head (read back by ``MtpWeights.from_pretrained``), paired; the same for each
   ``finetune.eval_traces`` trace (all its prompts).
"""

from __future__ import annotations

import os
import time
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import MtpWeights

from ..reporting.kept import write_json, write_text
from ..traces.format import Trace, open_trace
from . import finetune_dist as dp
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
def mean_loss(w: MtpWeights, items: list[Any], depth: int, feed_hidden: str) -> float:
    """The items' mean ``item_loss``."""
    return sum(float(item_loss(w, it, depth, feed_hidden)[0]) for it in items) / len(items)


def plot_losses(loss: list[dict[str, Any]], path: str) -> None:
    """Train and held-out loss against steps, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in loss]
    ax.plot(steps, [r["train"] for r in loss], "o-", label="train (the step's batch)")
    ax.plot(steps, [r["heldout"] for r in loss], "s-", label="held-out prompts")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy vs the target's argmax (nats)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(cfg: Any, model_cfg: MtpConfig, stored: dict[str, Tensor], trace: Trace, split: PromptSplit,
          log: Any, rank: int = 0, world: int = 1) -> tuple[dict[str, Tensor], list[dict[str, Any]], int, bool]:
    """The training loop (module docstring, 2): the masters, the loss records, steps run and
    whether ``finetune.max_minutes`` stopped it early. ``rank`` of ``world`` data-parallel ranks
    (``finetune_dist``; a joined process group when ``world`` > 1): this rank trains on its share
    of each step's batch; the held-out loss, the records and the bar are rank 0's."""
    from tqdm import tqdm

    f = cfg.finetune
    masters = master_copies(stored, model_cfg.layer_prefix, tuple(f.get("trainable") or ()))
    params = list(masters.values())
    opt = torch.optim.AdamW(params, lr=f.lr, betas=(0.9, 0.95), weight_decay=f.weight_decay)
    train_items = [trace.items[i] for i in split.train_items]
    held_items = [trace.items[i] for i in split.heldout_items]
    gen = torch.Generator().manual_seed(f.seed)
    deadline = time.perf_counter() + 60 * f.max_minutes
    records: list[dict[str, Any]] = []
    bar = tqdm(range(f.steps), desc="finetune", dynamic_ncols=True, mininterval=2, disable=rank != 0)
    step, stopped = 0, False
    for step in bar:
        # Every rank draws the whole batch from the same generator, then takes its share.
        pick = torch.randint(0, len(train_items), (f.batch_size,), generator=gen).tolist()
        w = weights_of(model_cfg, stored, masters)
        opt.zero_grad(set_to_none=True)
        mine = dp.share(pick, rank, world)
        local = torch.stack([item_loss(w, train_items[i], f.depth, f.feed_hidden)[0] for i in mine]).sum()
        (local / f.batch_size).backward()  # this rank's part of the global batch's mean
        dp.sum_gradients(params, world)  # the global mean's gradient on every rank
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, f.grad_clip))
        opt.step()
        train_loss = dp.sum_over_ranks(float(local.detach()), world) / f.batch_size
        bar.set_postfix(loss=f"{train_loss:.3f}")
        log.log({"train/loss": train_loss, "train/grad_norm": gnorm}, step=step)
        last = step == f.steps - 1 or dp.rank0_says(time.perf_counter() >= deadline, world)
        if rank == 0 and (step % f.eval_every == 0 or last):
            held = mean_loss(weights_of(model_cfg, stored, masters), held_items, f.depth, f.feed_hidden)
            records.append({"step": step, "train": train_loss, "heldout": held})
            log.log({"heldout/loss": held}, step=step)
            tqdm.write(f"step {step}: train {train_loss:.4f} held-out {held:.4f}")
        if last:
            stopped = step < f.steps - 1
            break
    bar.close()
    return masters, records, step + 1, stopped


def model_card(cfg: Any, trace: Trace, split: PromptSplit, steps: int, stopped: bool, loss: list[dict[str, Any]],
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
        "", "Same trace, seed, thread count and rank count: byte-identical tensors.", ""]
    return "\n".join(lines)


def run(cfg: Any, run_dir: str, checked: tuple[str, MtpConfig, dict[str, Any], PromptSplit],
        command: str) -> dict[str, Any] | None:
    """Fine-tune, write and judge (module docstring); returns summary.json's record, or
    ``None`` on a data-parallel rank other than 0 (which writes nothing)."""
    from omegaconf import OmegaConf

    from glm_mtp.registry import parse_dtype

    from ..reporting.wandb_log import NoLogger, make_logger

    model_dir, model_cfg, _, split = checked
    f, mcfg = cfg.finetune, cfg.model
    rank, world = dp.world_from_env()
    started = dp.start(world)
    torch.set_num_threads(f.threads)
    torch.manual_seed(f.seed)
    import logging

    logging.getLogger("glm_mtp").setLevel(logging.WARNING)  # the drafter logs every prefill at INFO
    t0 = time.perf_counter()
    trace = open_trace(cfg.trace.path)
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)  # the composed config is a mapping
    # The ranks must train on the same items with the same draws: refuse before any work if not.
    dp.check_agree("the trace, the split and finetune.*", (trace.sha256, split.record(), config["finetune"]), world)
    stored, files = input_tensors(model_dir)
    if world > 1:  # hashing the tensors costs a pass over them: only where there is another rank to agree with
        dp.check_agree("the input checkpoint's tensors (sha256)", dp.digest(stored), world)
    if rank == 0:
        os.makedirs(f.out, exist_ok=True)
        os.makedirs(run_dir, exist_ok=True)
        log = make_logger(cfg.logger, run_dir, cast(dict[str, Any], config), job_type="finetune",
                          group=cfg.get("group"))
    else:
        log = NoLogger()
    masters, loss, steps, stopped = train(cfg, model_cfg, stored, trace, split, log, rank, world)
    if world > 1:
        dp.check_agree("the tuned masters (sha256)", dp.digest(masters), world)
    dp.finish(started)
    if rank != 0:
        return None
    write_json(os.path.join(run_dir, LOSS_FILE), {"steps": steps, "stopped_early": stopped, "loss": loss})  # kept
    write_checkpoint(model_dir, f.out, tuned_tensors(stored, masters), files)
    train_minutes = (time.perf_counter() - t0) / 60

    dtype = parse_dtype(mcfg.dtype)
    share = mcfg.get("index_share")
    base = MtpWeights.from_pretrained(model_dir, dtype=dtype).with_index_share(share)
    tuned = MtpWeights.from_pretrained(f.out, dtype=dtype).with_index_share(share)
    max_seq_len = min(mcfg.max_seq_len, model_cfg.max_position_embeddings)
    from .finetune_judge import judge

    replay = judge(trace, split.heldout_items, base, tuned, f.num_drafts, max_seq_len, f.feed_hidden, f.seed)
    evals = []
    for path in f.get("eval_traces") or []:
        extra = open_trace(path)
        evals.append({"path": path, **judge(extra, list(range(len(extra.items))), base, tuned, f.num_drafts,
                                            max_seq_len, f.feed_hidden, f.seed)})
    summary = {"command": command, "model": model_dir, "out": f.out, "trace": trace.record(),
               "split": split.record(), "steps": steps, "stopped_early": stopped,
               "settings": OmegaConf.to_container(f, resolve=True), "loss": loss, "replay": replay,
               "eval_traces": evals, "train_minutes": train_minutes, "world_size": world}
    png = os.path.join(f.out, "loss_curve.png")
    plot_losses(loss, png)
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
