"""Training a small GLM-5-architecture target and its MTP head jointly on the Python stdlib
(the entry point is ``python -m glm_mtp.experiments.train``; ``run`` is its job).

Loss = CE(target) + mtp_loss_weight * mean_k CE(MTP depth k), k = 1..mtp_depth, the MTP layer
unrolled with shared weights (DeepSeek-V3 / GLM-5): depth k's row r pairs token ``t_{r+k}`` with
the previous depth's output at row r (the target's final-normed hidden for k = 1) and predicts
``t_{r+k+1}``. Gradients of the MTP loss reach the target, as in those models. Experts are kept
balanced without an auxiliary loss: after each step every routing bias moves by
``bias_update_rate`` toward under-loaded experts (DeepSeek-V3's aux-loss-free balancing).

The indexer: GLM-5's lightning indexer (family ``glm5``) is not trained, so its windows
(``seq_len``) must fit ``index_topk`` (DSA then attends to every visible row). The glm5_next
family's KPool indexer is trained (``experiments.training.indexer_loss``): every layer attends through the
KPool selection, as at inference, and the indexer learns from DSA's KL against the detached dense
attention, aggregated to pools, weighted by ``train.indexer_loss_weight``; its windows may be
longer than ``index_topk``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_mtp.reference.attention import KPoolRowsFn, Rope
from glm_mtp.reference.block import BlockHooks, MoeFn, embed_rows, mtp_rows
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.kpool import kpool_rows
from glm_mtp.reference.numerics import VENDOR
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache, num_blocks
from glm_mtp.reference.weights import MoeWeights, MtpWeights, mtp_tensor_shapes, random_tensor

from ..reporting.kept import RecordLog, keeping, late_failure, replaced, write_json
from .bpe import BpeTokenizer
from .corpus import Corpus, Split, corpus_split, read_item
from .indexer_loss import IndexerDistill
from .model_card import model_card
from ..targets.target import ExpertLoad, Target, TargetWeights, grouped_moe


# ------------------------------------------------------------------------------------------------
# Parameters


def trainable(weights: Any, skip: tuple[str, ...] = ("e_score_correction_bias",)) -> list[Tensor]:
    """Make every tensor of a weights dataclass (recursively, lists too) a leaf that requires
    grad, except fields named in ``skip``; returns them (each once)."""
    params: dict[int, Tensor] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, list):
            return [walk(x) for x in obj]
        if not hasattr(obj, "__dataclass_fields__"):
            return obj
        for name in obj.__dataclass_fields__:
            v = getattr(obj, name)
            if isinstance(v, Tensor):
                if name in skip:
                    continue
                if id(v) not in params:
                    params[id(v)] = v.detach().clone().requires_grad_(True)
                setattr(obj, name, params[id(v)])
            else:
                walk(v)
        return obj

    walk(weights)
    return list(params.values())


def build_models(cfg: MtpConfig, seed: int) -> tuple[TargetWeights, MtpWeights, list[Tensor]]:
    """Random float32 target and MTP layer sharing one embedding and one head; their parameters."""
    target = TargetWeights.random(cfg, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    mtp_t = {n: random_tensor(n, s, gen) for n, s in mtp_tensor_shapes(cfg).items()}
    mtp = MtpWeights.from_tensors(cfg, mtp_t, target.embed_tokens, target.lm_head)
    # One leaf per tensor: the MTP layer reads the target's embedding and head objects.
    params = trainable([target, mtp])
    mtp.embed_tokens, mtp.lm_head = target.embed_tokens, target.lm_head
    return target, mtp, params


def encoded_streams(tok: BpeTokenizer, tokenizer_file: Any, split: Split) -> tuple[Tensor, Tensor]:
    """The two splits' token streams (items joined by a blank line), cached on disk under
    ``$GLM_MTP_CACHE`` (default ``~/.cache/glm_mtp``) keyed by the tokenizer file's and the split's
    sha256: every job of a grid on one base encodes the same 11 MB of text."""
    import hashlib
    from pathlib import Path

    key = hashlib.sha256(Path(tokenizer_file).read_bytes() + split.digest().encode()
                         + json.dumps([split.train, split.heldout]).encode()).hexdigest()[:24]
    cache = Path(os.environ.get("GLM_MTP_CACHE", Path.home() / ".cache" / "glm_mtp")) / f"streams-{key}.pt"
    if cache.exists():
        d = torch.load(cache)
        return d["train"], d["heldout"]
    enc = lambda names: torch.tensor(tok.encode("\n\n".join(read_item(n) for n in names)), dtype=torch.int64)  # noqa: E731
    train_s, heldout_s = enc(split.train), enc(split.heldout)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        torch.save({"train": train_s, "heldout": heldout_s}, tmp)
        os.replace(tmp, cache)
    except OSError:  # a read-only home: encode every time
        pass
    return train_s, heldout_s


def base_models(base: str, seed: int,
                limit_items: int | None = None) -> tuple[Corpus, TargetWeights, MtpWeights, list[Tensor]]:
    """A trained checkpoint's target, tokenizer and split (``base``: ``shipped`` or a directory the
    training wrote) and a fresh random MTP layer on its embedding and head (seeded as
    ``build_models`` seeds it). Only the MTP layer's tensors are returned as parameters: the target,
    its embedding and its head stay frozen, so MTP variants trained on one base share their target
    and their acceptance compares the heads alone (FastMTP trains its head on a frozen model too)."""
    from ..targets.checkpoint import load_checkpoint

    model = load_checkpoint(None if base == "shipped" else base, torch.float32)
    corpus = checkpoint_corpus(model.path, model.tokenizer, limit_items, "train.base")
    target, cfg = model.target, model.mtp.config
    gen = torch.Generator().manual_seed(seed + 1)
    mtp_t = {n: random_tensor(n, s, gen) for n, s in mtp_tensor_shapes(cfg).items()}
    mtp = MtpWeights.from_tensors(cfg, mtp_t, target.embed_tokens, target.lm_head)
    params = trainable(mtp, skip=("e_score_correction_bias", "embed_tokens", "lm_head"))
    return corpus, target, mtp, params


def checkpoint_corpus(path: Any, tok: BpeTokenizer, limit_items: int | None, key: str) -> Corpus:
    """The corpus of a trained checkpoint at ``path``: its tokenizer ``tok`` and its split (which
    must be the split this machine makes: ``key`` names the setting in the error), the streams
    encoded (and cached, ``encoded_streams``). ``limit_items`` keeps the first items of each split."""
    from pathlib import Path

    recorded = json.loads((Path(path) / "corpus.json").read_text())
    split = corpus_split()
    if split.digest() != recorded["sha256"]:
        raise ValueError(f"{key}={path}: the corpus split here ({split.digest()[:12]}) is not the checkpoint's "
                         f"({recorded['sha256'][:12]}); another Python version's standard library?")
    if limit_items:
        split = Split(split.train[:limit_items], split.heldout[:limit_items], split.overlap)
    return Corpus(split, tok, *encoded_streams(tok, Path(path) / "tokenizer.json", split))


def tokenizer_corpus(path: str, limit_items: int | None) -> Corpus:
    """``tokenizer.path``: the tokenizer and split of a trained checkpoint (``shipped`` or a
    directory), reused instead of training a BPE (the streams are cached across runs)."""
    from ..targets.checkpoint import shipped_checkpoint

    directory = shipped_checkpoint() if path == "shipped" else path
    return checkpoint_corpus(directory, BpeTokenizer.load(os.path.join(directory, "tokenizer.json")), limit_items,
                             "tokenizer.path")


def moe_layers(target: TargetWeights, mtp: MtpWeights, frozen_target: bool = False) -> list[MoeWeights]:
    """The MoE layers whose routing biases training balances (the MTP layer's alone when the
    target is frozen)."""
    layers = [mtp.layer] if frozen_target else [*target.layers, mtp.layer]
    return [l.mlp for l in layers if isinstance(l.mlp, MoeWeights)]


# ------------------------------------------------------------------------------------------------
# Forward passes


def embed_unmasked(w: MtpWeights, tokens: Tensor, slots: Tensor) -> Tensor:
    """``BlockHooks.embed`` of the unroll's deeper depths: ``embed_tokens[tokens]``, no row zeroed
    (their row 0 is not the start of the text)."""
    return F.embedding(tokens, w.embed_tokens)


def mtp_forward(w: MtpWeights, tokens: Tensor, hiddens: Tensor, zero_first: bool, moe: MoeFn,
                kpool: KPoolRowsFn = kpool_rows) -> tuple[Tensor, Tensor]:
    """``reference.block.mtp_rows`` on a fresh cache with rows at slots ``[0, T)``, with torch's
    kernels (``VENDOR``: autograd, dense MLA) and an injectable MoE: returns ``(x, logits)``.
    ``zero_first`` zeroes row 0's embedding, as the block does at position 0 (depth 1 only;
    deeper rows of the unroll start later in the text). ``kpool``: the KPool indexer (glm5_next)."""
    cfg = w.config
    T = tokens.shape[0]
    blocks = num_blocks(T)
    cache = LayerCache.allocate(cfg, blocks, hiddens.dtype, hiddens.device)
    rope = Rope.build(cfg, BLOCK_ROWS * blocks, hiddens.device)
    hooks = BlockHooks(ops=VENDOR, embed=embed_rows if zero_first else embed_unmasked, moe=moe, kpool=kpool)
    out = mtp_rows(w, tokens, hiddens, torch.arange(T), cache, rope, hooks=hooks)
    return out.x, VENDOR.linear(out.x, w.lm_head)


@dataclass
class Losses:
    target: Tensor
    mtp: list[Tensor]  # per depth
    mtp_acc: list[float]  # top-1 accuracy per depth (against the text)
    indexer: Tensor | None = None  # glm5_next: the KPool indexer's mean KL (indexer_loss); None in glm5
    recall: float = float("nan")  # glm5_next: mean share of the dense attention the selections kept


def sequence_losses(target: TargetWeights, mtp: MtpWeights, window: Tensor, depth: int, moe: MoeFn,
                    distill: float = 0.0) -> Losses:
    """Losses of one window ``t_0..t_T`` (T + 1 tokens).

    ``distill`` in [0, 1] mixes into each MTP loss a soft cross-entropy against the target's own
    (detached) prediction of the same token: depth k's row r predicts ``t_{r+k+1}``, which the
    target predicts at position ``r+k``. Acceptance asks the drafter to agree with the target,
    not with the text, so this aims the head at what verification checks (self-distillation)."""
    T = window.shape[0] - 1
    cfg = target.config
    indexer = IndexerDistill([l.attn for l in target.layers] + [mtp.layer.attn]) if cfg.is_next else None
    kpool = indexer or kpool_rows
    tg = Target(target, max_seq_len=T, moe=moe, kpool=kpool)
    out = tg.forward(window[:-1], tg.alloc_state())
    loss_t = F.cross_entropy(out.logits, window[1:])
    hidden, mtp_losses, accs = out.hidden, [], []
    for k in range(1, depth + 1):
        n = T - k  # rows r = 0..T-k-1: token t_{r+k}, previous depth's row r, predicts t_{r+k+1}
        x, logits = mtp_forward(mtp, window[k : k + n], hidden[:n], zero_first=(k == 1), moe=moe, kpool=kpool)
        labels = window[k + 1 : k + 1 + n]
        loss = F.cross_entropy(logits, labels)
        if distill > 0:
            teacher = torch.softmax(out.logits[k : k + n].detach(), dim=-1)
            loss = (1 - distill) * loss + distill * F.cross_entropy(logits, teacher)
        mtp_losses.append(loss)
        accs.append(float((logits.argmax(-1) == labels).float().mean()))
        hidden = x
    if indexer is None:
        return Losses(loss_t, mtp_losses, accs)
    return Losses(loss_t, mtp_losses, accs, indexer.loss(), indexer.mean_recall())


# ------------------------------------------------------------------------------------------------
# Data


def build_corpus(vocab_size: int, sample_every: int, limit_items: int | None = None) -> Corpus:
    """Split, train the BPE on every ``sample_every``-th training item, tokenize both splits
    (items joined by a blank line). ``limit_items`` keeps the first items of each split (tests)."""
    split = corpus_split()
    if limit_items:
        split = Split(split.train[:limit_items], split.heldout[:limit_items], split.overlap)
    train_texts = [read_item(n) for n in split.train]
    tok = BpeTokenizer.train(train_texts[::sample_every], vocab_size)
    enc = lambda texts: torch.tensor(tok.encode("\n\n".join(texts)), dtype=torch.int64)  # noqa: E731
    return Corpus(split, tok, enc(train_texts), enc([read_item(n) for n in split.heldout]))


def sample_windows(stream: Tensor, n: int, length: int, gen: torch.Generator) -> Tensor:
    """``n`` random windows of ``length`` tokens: (n, length)."""
    starts = torch.randint(0, stream.shape[0] - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def lr_at(step: int, steps: int, lr: float, min_lr: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr`` at ``steps``: a
    function of the step alone, so a rerun on a faster or slower machine follows the same rates
    (``train.max_minutes`` may still stop a run early; the card then says so)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def evaluate(target: TargetWeights, mtp: MtpWeights, windows: Tensor, depth: int) -> dict[str, float]:
    """Mean held-out losses and MTP accuracies over ``windows`` (fixed, so curves compare)."""
    tot: dict[str, float] = {}
    for w in windows:
        ls = sequence_losses(target, mtp, w, depth, grouped_moe)
        vals = {"target_loss": float(ls.target), **{f"mtp{k + 1}_loss": float(l) for k, l in enumerate(ls.mtp)},
                **{f"mtp{k + 1}_acc": a for k, a in enumerate(ls.mtp_acc)}}
        if ls.indexer is not None:
            vals.update(indexer_kl=float(ls.indexer), indexer_recall=ls.recall)
        for k, v in vals.items():
            tot[k] = tot.get(k, 0.0) + v / len(windows)
    return tot


# ------------------------------------------------------------------------------------------------


def save_trained_model(directory: str, target: TargetWeights, mtp: MtpWeights, corpus: Corpus, card: str,
                       extra_files: dict[str, Any]) -> None:
    """Safetensors in GLM-5 naming (the MTP layer at ``model.layers.{L}``), config.json, the
    tokenizer, the corpus split, and the model card."""
    mtp_d = MtpWeights.from_tensors(mtp.config, {n: t.detach() for n, t in mtp.mtp_tensors().items()},
                                    mtp.embed_tokens.detach(), mtp.lm_head.detach())
    # Clones: safetensors refuses tensors that share storage (stacked experts are views).
    extra = {n: t.detach().clone() for n, t in target.state_dict().items()}
    os.makedirs(directory, exist_ok=True)
    mtp_d.save_pretrained(directory, extra=extra)
    corpus.tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "corpus.json"), "w") as f:
        overlap = {n: {"lines": round(o.lines, 4), "ngrams": round(o.ngrams, 4)}
                   for n, o in corpus.split.overlap.items() if n in corpus.split.heldout}
        json.dump({"sha256": corpus.split.digest(), "train": corpus.split.train, "heldout": corpus.split.heldout,
                   "heldout_overlap": overlap}, f, indent=0)
    for name, obj in extra_files.items():
        with open(os.path.join(directory, name), "w") as f:
            json.dump(obj, f, indent=1)
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(card)


def plot_curves(history: list[dict[str, float]], evals: list[dict[str, float]], path: str) -> None:
    """Train and held-out losses against steps, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["target_loss"] for h in history], label="target (train)", alpha=0.6)
    ax.plot(steps, [h["mtp1_loss"] for h in history], label="MTP depth 1 (train)", alpha=0.6)
    if evals:
        es = [e["step"] for e in evals]
        ax.plot(es, [e["target_loss"] for e in evals], "o-", label="target (held-out)")
        ax.plot(es, [e["mtp1_loss"] for e in evals], "s-", label="MTP depth 1 (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend(loc="upper right")  # "best" searches the data: slow on long runs, and it warns
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Models:
    """What a run trains: the corpus, the target, the MTP layer, their config and trainable tensors."""

    corpus: Corpus
    target: TargetWeights
    mtp: MtpWeights
    config: MtpConfig
    params: list[Tensor]


def prepare_models(cfg: Any) -> Models:
    """The corpus and the models: a trained target, frozen, with a fresh MTP layer (``train.base``:
    ``cfg.arch`` and ``cfg.tokenizer`` are the checkpoint's), or both fresh on a corpus built (or
    reused, ``tokenizer.path``) here."""
    from omegaconf import OmegaConf

    t = cfg.train
    base = t.get("base")
    if base:
        corpus, target, mtp, params = base_models(base, t.seed, cfg.tokenizer.limit_items)
        mcfg = mtp.config
    else:
        if cfg.tokenizer.get("path"):
            corpus = tokenizer_corpus(cfg.tokenizer.path, cfg.tokenizer.limit_items)
        else:
            corpus = build_corpus(cfg.tokenizer.vocab_size, cfg.tokenizer.sample_every, cfg.tokenizer.limit_items)
        mcfg = MtpConfig(**OmegaConf.to_container(cfg.arch), vocab_size=corpus.tokenizer.vocab_size)
    if t.seq_len > mcfg.index_topk and not mcfg.is_next:
        raise ValueError(f"train.seq_len ({t.seq_len}) must be <= arch.index_topk ({mcfg.index_topk}): GLM-5's indexer "
                         "is not trained (the glm5_next family's KPool indexer is)")
    if not base:
        target, mtp, params = build_models(mcfg, t.seed)
    return Models(corpus, target, mtp, mcfg, params)


def make_optimizer(t: Any, params: list[Tensor]) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(0.9, 0.95))


def train_step(t: Any, m: Models, opt: torch.optim.Optimizer, batch: Tensor, moe: MoeFn,
               indexer_weight: float) -> dict[str, float]:
    """One optimizer step over ``batch`` (windows, each its own forward): the losses averaged
    over the batch, the gradient norm before clipping."""
    tot_t, tot_m, accs = 0.0, [0.0] * t.mtp_depth, [0.0] * t.mtp_depth
    tot_ix, tot_recall = 0.0, 0.0
    opt.zero_grad(set_to_none=True)
    for window in batch:
        ls = sequence_losses(m.target, m.mtp, window, t.mtp_depth, moe, t.mtp_distill)
        loss = ls.target + t.mtp_loss_weight * torch.stack(ls.mtp).mean()
        if ls.indexer is not None:  # glm5_next: the KPool indexer's KL (its inputs detached)
            loss = loss + indexer_weight * ls.indexer
            tot_ix += float(ls.indexer.detach()) / t.batch_size
            tot_recall += ls.recall / t.batch_size
        (loss / t.batch_size).backward()
        tot_t += float(ls.target.detach()) / t.batch_size
        for k in range(t.mtp_depth):
            tot_m[k] += float(ls.mtp[k].detach()) / t.batch_size
            accs[k] += ls.mtp_acc[k] / t.batch_size
    gnorm = float(torch.nn.utils.clip_grad_norm_(m.params, t.grad_clip))
    opt.step()
    rec = {"grad_norm": gnorm, "target_loss": tot_t,
           **{f"mtp{k + 1}_loss": tot_m[k] for k in range(t.mtp_depth)},
           **{f"mtp{k + 1}_acc": accs[k] for k in range(t.mtp_depth)}}
    if m.config.is_next:
        rec.update(indexer_kl=tot_ix, indexer_recall=tot_recall)
    return rec


def rebalance_experts(m: Models, load: ExpertLoad, rate: float, frozen_target: bool) -> None:
    """Aux-loss-free balancing: nudge every routing bias toward under-loaded experts."""
    with torch.no_grad():
        for layer in moe_layers(m.target, m.mtp, frozen_target=frozen_target):
            c = load.counts.get(id(layer.router))
            if c is not None:
                layer.e_score_correction_bias += rate * torch.sign(c.float().mean() - c.float())
    load.counts.clear()


def run(cfg: Any, run_dir: str, command: str = "python -m glm_mtp.experiments.train") -> dict[str, float]:
    """Train per ``cfg`` (conf/train.yaml), log to ``run_dir``; returns the final metrics.
    ``command`` is recorded in the model card."""
    from omegaconf import OmegaConf

    from ..reporting.wandb_log import make_logger

    t = cfg.train
    os.makedirs(run_dir, exist_ok=True)
    torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    t0 = time.perf_counter()
    m = prepare_models(cfg)
    opt = make_optimizer(t, m.params)
    eval_windows = sample_windows(m.corpus.heldout, t.eval_windows, t.seq_len + 1,
                                  torch.Generator().manual_seed(t.seed + 7))
    log = make_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="train",
                      group=cfg.get("group"))
    print(f"corpus: {m.corpus.train.numel()} train / {m.corpus.heldout.numel()} held-out tokens, vocab "
          f"{m.corpus.tokenizer.vocab_size}, setup {time.perf_counter() - t0:.0f}s, "
          f"{sum(p.numel() for p in m.params) / 1e6:.2f}M parameters")
    # Every step's record and every held-out evaluation, on disk as it is made (reporting.kept):
    # a failure later in the run (a step, the checkpoint, the plot, the logger) keeps them.
    records = RecordLog(os.path.join(run_dir, TRAINING_LOG))
    with keeping("training", records):
        history, evals, steps = train_loop(cfg, m, opt, eval_windows, log, t0, records)
    minutes = (time.perf_counter() - t0) / 60
    recent = history[-t.log_every:]
    final = {**evals[-1], "train_target_loss": sum(h["target_loss"] for h in recent) / len(recent),
             "train_mtp1_loss": sum(h["mtp1_loss"] for h in recent) / len(recent), "minutes": minutes, "steps": steps}
    try:
        write_outputs(cfg, run_dir, m, log, history, evals, final, command)
    except Exception as e:
        raise late_failure("writing the training's files", e,
                           [os.path.join(run_dir, "final.json"), records.path, *([cfg.out] if cfg.out else [])]) from e
    return final


# The run folder's log of every step's record ({"kind": "train", ...}) and held-out evaluation
# ({"kind": "heldout", ...}), one JSON object a line, appended as each is made.
TRAINING_LOG = "training_log.jsonl"


def train_loop(cfg: Any, m: Models, opt: torch.optim.Optimizer, eval_windows: Tensor, log: Any, t0: float,
               records: RecordLog | None = None) -> tuple[list[dict[str, float]], list[dict[str, float]], int]:
    """The steps, logged every ``log_every`` and evaluated every ``eval_every`` and at the end:
    the step records, the evaluations and how many steps ran; each record also goes to
    ``records`` as it is made. The ``max_minutes`` budget covers the whole run: training stops a
    minute early for the last eval and saving."""
    from tqdm import tqdm

    t = cfg.train
    indexer_weight = float(t.get("indexer_loss_weight", 0.0))
    gen = torch.Generator().manual_seed(t.seed)
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    load = ExpertLoad()
    moe = partial(grouped_moe, load=load)
    deadline = t0 + 60 * (t.max_minutes - 1)
    bar = tqdm(range(t.steps), desc="train", dynamic_ncols=True, mininterval=5)
    step = 0
    for step in bar:
        lr = lr_at(step, t.steps, t.lr, t.min_lr, t.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_windows(m.corpus.train, t.batch_size, t.seq_len + 1, gen)
        rec = {"step": step, "lr": lr, **train_step(t, m, opt, batch, moe, indexer_weight)}
        rebalance_experts(m, load, t.bias_update_rate, frozen_target=bool(t.get("base")))
        history.append(rec)
        if records is not None:
            records.append({"kind": "train", **rec})
        bar.set_postfix(loss=f"{rec['target_loss']:.3f}", mtp1=f"{rec['mtp1_loss']:.3f}", acc1=f"{rec['mtp1_acc']:.2f}")
        if step % t.log_every == 0:
            log.log({f"train/{k}": v for k, v in rec.items() if k != "step"}, step=step)
        last = step == t.steps - 1 or time.perf_counter() >= deadline
        if step % t.eval_every == 0 or last:
            ev = {"step": step, **evaluate(m.target, m.mtp, eval_windows, t.mtp_depth)}
            evals.append(ev)
            if records is not None:
                records.append({"kind": "heldout", **ev})
            log.log({f"heldout/{k}": v for k, v in ev.items() if k != "step"}, step=step)
            tqdm.write(f"step {step}: held-out target {ev['target_loss']:.3f} mtp1 {ev['mtp1_loss']:.3f} acc1 "
                       f"{ev['mtp1_acc']:.3f}")
        if last:
            if step < t.steps - 1:
                tqdm.write(f"stopping at step {step}: the train.max_minutes={t.max_minutes} budget is spent")
            break
    bar.close()
    return history, evals, step + 1


def write_outputs(cfg: Any, run_dir: str, m: Models, log: Any, history: list[dict[str, float]],
                  evals: list[dict[str, float]],
                  final: dict[str, float], command: str) -> None:
    """The run's files (final.json, loss curve), its W&B summary and, with ``out``, the checkpoint
    and its model card. What was measured is written first (final.json, then the checkpoint),
    each whole or not at all (``reporting.kept``; ``save_pretrained`` replaces a checkpoint as a
    whole); the plot and the logger come after them."""
    from ..targets.provenance import git_commit

    write_json(os.path.join(run_dir, "final.json"), final)
    print(json.dumps(final, indent=1))
    if cfg.out:
        card = model_card(cfg, m.config, m.corpus, final, final["minutes"], final["steps"], command)
        save_trained_model(cfg.out, m.target, m.mtp, m.corpus, card,
                           {"training_log.json": {"history": history, "evals": evals, "final": final}})
        print(f"checkpoint written to {cfg.out}")
    png = os.path.join(run_dir, "loss_curve.png")
    with replaced(png) as tmp:
        plot_curves(history, evals, tmp)
    if cfg.out:
        import shutil

        shutil.copy(png, os.path.join(cfg.out, "loss_curve.png"))
    log.log_image("loss_curve", png)
    log.summary({**{f"final/{k}": v for k, v in final.items()}, "corpus_sha256": m.corpus.split.digest(),
                 "git_commit": git_commit()})
    log.finish()
