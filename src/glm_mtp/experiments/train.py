"""Train a small GLM-5-architecture target and its MTP head jointly on the Python stdlib.

    python -m glm_mtp.experiments.train                         # defaults: conf/train.yaml
    python -m glm_mtp.experiments.train out=checkpoints/NAME    # also write the shipped checkpoint

Loss = CE(target) + mtp_loss_weight * mean_k CE(MTP depth k), k = 1..mtp_depth, the MTP layer
unrolled with shared weights (DeepSeek-V3 / GLM-5): depth k's row r pairs token ``t_{r+k}`` with
the previous depth's output at row r (the target's final-normed hidden for k = 1) and predicts
``t_{r+k+1}``. Gradients of the MTP loss reach the target, as in those models. Experts are kept
balanced without an auxiliary loss: after each step every routing bias moves by
``bias_update_rate`` toward under-loaded experts (DeepSeek-V3's aux-loss-free balancing).

The indexer: GLM-5's lightning indexer (family ``glm5``) is not trained, so its windows
(``seq_len``) must fit ``index_topk`` (DSA then attends to every visible row). The glm5_next
family's KPool indexer is trained (``experiments.indexer_loss``): every layer attends through the
KPool selection, as at inference, and the indexer learns from DSA's KL against the detached dense
attention, aggregated to pools, weighted by ``train.indexer_loss_weight``; its windows may be
longer than ``index_topk``.
"""

from __future__ import annotations

import json
import math
import os
import sys
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

from .bpe import BpeTokenizer
from .corpus import Split, corpus_split, read_item
from .indexer_loss import IndexerDistill
from .target import ExpertLoad, Target, TargetWeights, grouped_moe, target_tensor_shapes


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
    from .checkpoint import load_checkpoint

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
    from .checkpoint import shipped_checkpoint

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


@dataclass
class Corpus:
    """Token streams of the two splits and the tokenizer."""

    split: Split
    tokenizer: BpeTokenizer
    train: Tensor  # (N,) int64
    heldout: Tensor  # (M,) int64


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


def model_card(cfg: Any, mcfg: MtpConfig, corpus: Corpus, final: dict[str, float], minutes: float, steps: int,
               command: str) -> str:
    """The checkpoint's README."""
    n_params = sum(math.prod(s) for s in target_tensor_shapes(mcfg).values())
    n_mtp = sum(math.prod(s) for s in mtp_tensor_shapes(mcfg).values())
    from . import corpus as corpus_mod

    t = cfg.train
    ov = [o for n, o in corpus.split.overlap.items() if n in corpus.split.heldout]
    max_lines, max_grams = max((o.lines for o in ov), default=0.0), max((o.ngrams for o in ov), default=0.0)
    repro_test = ("`tests/experiments/test_train_next.py` (sha256 of the written files, twice; another seed differs)"
                  if mcfg.is_next
                  else "`tests/experiments/test_train_repro.py` (sha256 of the written files, one run on a clock\n"
                       "a thousand times slower)")
    tok_path = cfg.tokenizer.get("path")
    reused = (f"; reused from `tokenizer.path={tok_path}` (the same split, checked by its sha256), not retrained"
              if tok_path else "")
    based = (f"\n\nBase: the target, embedding, head and tokenizer of `train.base={t.base}`, frozen; only the MTP "
             "layer was trained (from a random start), so the target losses below are the base's."
             if t.get("base") else "")
    stopped = ("" if steps == t.steps
               else f"\nStopped by `train.max_minutes` at step {steps} of {t.steps}: the schedule did not finish.")
    title, architecture = card_architecture(cfg, mcfg, n_params, n_mtp)
    return f"""{title}

Trained by this package on the Python standard library, so acceptance-rate numbers can be
re-derived on any machine. {architecture}

## Command

```
{command}
```

({steps} steps of {t.batch_size} x {t.seq_len} tokens, {minutes:.1f} minutes with {t.threads} CPU thread(s), torch {torch.__version__},
Python {".".join(map(str, sys.version_info[:3]))}; seed {t.seed}; MTP loss weight {t.mtp_loss_weight}, MTP unrolled {t.mtp_depth} times with shared
weights, self-distillation share {t.mtp_distill}.){stopped}{based}

Reproducible: the learning rate is a function of the step alone (linear warm-up over {t.warmup} steps,
cosine from {t.lr:g} to {t.min_lr:g} at step {t.steps}, `training_log.json` holds the rate of every step),
windows are drawn from a generator seeded with the seed, and torch runs `train.threads` = {t.threads}
thread(s) (set by the command: the reductions' order depends on the thread count). So the same
command on the same Python and torch gives a byte-identical `model.safetensors`; checked on short
runs by {repro_test}.

## Data

- Corpus: the `.py` files of the Python {".".join(map(str, sys.version_info[:3]))} standard library (tests, idlelib, turtledemo,
  lib2to3, ensurepip, site-packages excluded) and the `pydoc_data.topics` texts.
- Held-out: candidates are the items whose blake2b path hash falls in the {corpus_mod.HELDOUT_PERCENT}% bucket; a
  candidate stays held out only if at most {corpus_mod.MAX_OVERLAP:.0%} of its distinct lines of {corpus_mod.MIN_LINE_CHARS}+ characters and
  at most {corpus_mod.MAX_OVERLAP:.0%} of its distinct {corpus_mod.NGRAM}-word n-grams occur in training items (else it moves to
  training, repeated until none moves). Listed in `corpus.json` ({len(corpus.split.heldout)} held out, {len(corpus.split.train)} for training).
  Measured after the fix: at most {max_lines:.1%} of a held-out item's long lines and {max_grams:.1%} of its n-grams occur in training.
- Corpus file-list sha256: `{corpus.split.digest()}`
- Tokenizer: byte-level BPE, {corpus.tokenizer.vocab_size} tokens, trained on the training split (`tokenizer.json`,
  `glm_mtp.experiments.bpe.BpeTokenizer.load`){reused}. Training stream {corpus.train.numel()} tokens, held-out {corpus.heldout.numel()}.

## Final losses (nats; held-out over {t.eval_windows} fixed windows of {t.seq_len} tokens)

| | target | MTP depth 1 | MTP depth 1 top-1 acc |{' MTP depth 2 |' if t.mtp_depth >= 2 else ''}
|---|---|---|---|{'---|' if t.mtp_depth >= 2 else ''}
| held-out | {final['target_loss']:.4f} | {final['mtp1_loss']:.4f} | {final['mtp1_acc']:.4f} |{f" {final['mtp2_loss']:.4f} |" if t.mtp_depth >= 2 else ''}
| train (last {t.log_every} steps) | {final['train_target_loss']:.4f} | {final['train_mtp1_loss']:.4f} | | |

The loss curves are in `loss_curve.png`, every logged step in `training_log.json`.

## Load

```python
from glm_mtp.reference import MtpWeights
from glm_mtp.experiments.target import TargetWeights
mtp = MtpWeights.from_pretrained(dir)        # the MTP layer + embedding + head
target = TargetWeights.from_pretrained(dir)  # the target's layers
```

{card_indexer(cfg, mcfg, final)}
"""  # noqa: E501 (the card is markdown: its lines are the card's)


def card_architecture(cfg: Any, mcfg: MtpConfig, n_params: int, n_mtp: int) -> tuple[str, str]:
    """The model card's title and architecture paragraph, by family."""
    sizes = (f"Target {n_params / 1e6:.2f} M parameters (embedding and head included), MTP layer {n_mtp / 1e6:.2f} M. "
             "float32.")
    moe = f"sigmoid-routed MoE ({mcfg.n_routed_experts} experts, {mcfg.num_experts_per_tok} per token, 1 shared)"
    if not mcfg.is_next:
        return ("# glm5-mtp-stdlib: a small GLM-5-architecture target with its MTP layer",
                f"""Architecture: GLM-5 (`glm_moe_dsa`) at toy scale: {mcfg.num_hidden_layers} decoder
layers (the first {mcfg.first_k_dense_replace} dense), DSA attention (MLA + lightning indexer), sigmoid-routed MoE
({mcfg.n_routed_experts} experts, {mcfg.num_experts_per_tok} per token, 1 shared), and one MTP layer at `model.layers.{mcfg.num_hidden_layers}`.
{sizes}""")  # noqa: E501 (markdown)
    name = os.path.basename(os.path.normpath(cfg.out)) if cfg.get("out") else "glm5next-mtp"
    return (f"# {name}: a small target with GLM-5.3-Flash's MTP layer (glm5_next family)",
            f"""Architecture: the glm5_next family (DESIGN.md §7) at toy scale: {mcfg.num_hidden_layers} decoder layers
(the first {mcfg.first_k_dense_replace} dense), each with GLM-5.3-Flash's DSA attention (NoPE MLA, qk_nope {mcfg.qk_nope_head_dim}, no RoPE; KPool
indexer, `index_kpool` {mcfg.index_kpool}, `index_topk` {mcfg.index_topk}: {mcfg.kpool_pools_selected} pools of {mcfg.index_kpool} rows plus the row's own
incomplete pool), {moe} with the SwiGLU clamped at `swiglu_limit` {mcfg.swiglu_limit:g},
and one MTP layer at `{mcfg.layer_prefix.rstrip(".")}` (a plain pre-norm block, as in GLM-5.3-Flash).
{sizes}

Left out of GLM-5.3-Flash: its decoder's Kimi Delta Attention layers (the target here is DSA
layers only), the mHC hyper-connections (plain residuals here), the vision tower, the fp8
weights and the real widths; the MTP layer's structure is the release's (its config reads back as
`model_type: glm5_next`).""")  # noqa: E501 (markdown)


def card_indexer(cfg: Any, mcfg: MtpConfig, final: dict[str, float]) -> str:
    """The model card's paragraph on the indexer: untrained (GLM-5: keep contexts within
    ``index_topk``) or trained (glm5_next: how, and its held-out KL and recall)."""
    t = cfg.train
    if not mcfg.is_next:
        return f"""The lightning indexer is not trained (training windows fit in `index_topk` = {mcfg.index_topk} rows, so DSA
attends to every visible row); keep contexts within {mcfg.index_topk} rows."""  # noqa: E501 (markdown)
    return f"""## The KPool indexer: trained

Training windows of {t.seq_len} tokens are {t.seq_len / mcfg.index_topk:g}x `index_topk` = {mcfg.index_topk}, so selection is real. Every
layer (the target's {mcfg.num_hidden_layers} and the MTP layer) attends through the KPool selection in the training
forward, as at inference (torch's kernels, `kpool.kpool_rows` with `ops=VENDOR`); the selection is
discrete, so the language-model losses never reach the indexer. The indexer is trained end to end
alongside the model by its own loss, DSA's sparse-stage indexer KL (DeepSeek-V3.2) aggregated to
pools: for each row with at least two candidate pools, KL(dense attention mass per candidate pool,
head-averaged, detached and renormalised || softmax of the indexer's pool scores), weight
`train.indexer_loss_weight` = {t.get("indexer_loss_weight", 0.0)}. The indexer's inputs are detached (its queries, head
weights, gates and keys are recomputed from the detached layer input), so that KL trains the
indexer (`wq_b`, `wk`, `k_norm`, `weights_proj`, the KPool gate and `ape`) and nothing else
(`experiments/indexer_loss.py`). No dense warm-up stage: the indexer starts random.

Held-out at the end: indexer KL {final.get("indexer_kl", float("nan")):.4f} nats per scored row, mean recall {final.get("indexer_recall", float("nan")):.4f}
(the share of the dense head-averaged attention mass on the selected rows, every row of the
{t.eval_windows} windows and every layer)."""  # noqa: E501 (markdown)


def run(cfg: Any, run_dir: str, command: str = "python -m glm_mtp.experiments.train") -> dict[str, float]:
    """Train per ``cfg`` (conf/train.yaml), log to ``run_dir``; returns the final metrics.
    ``command`` is recorded in the model card."""
    from omegaconf import OmegaConf
    from tqdm import tqdm

    from .wandb_log import make_logger

    t = cfg.train
    os.makedirs(run_dir, exist_ok=True)
    torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    t0 = time.perf_counter()
    base = t.get("base")
    if base:  # a trained target, frozen; a fresh MTP layer (cfg.arch and cfg.tokenizer are the checkpoint's)
        corpus, target, mtp, params = base_models(base, t.seed, cfg.tokenizer.limit_items)
        mcfg = mtp.config
    else:
        if cfg.tokenizer.get("path"):
            corpus = tokenizer_corpus(cfg.tokenizer.path, cfg.tokenizer.limit_items)
        else:
            corpus = build_corpus(cfg.tokenizer.vocab_size, cfg.tokenizer.sample_every, cfg.tokenizer.limit_items)
        mcfg = MtpConfig(**OmegaConf.to_container(cfg.arch), vocab_size=corpus.tokenizer.vocab_size)
    if t.seq_len > mcfg.index_topk and not mcfg.is_next:
        raise ValueError(f"train.seq_len ({t.seq_len}) must be <= arch.index_topk ({mcfg.index_topk}): GLM-5's "
                         "indexer is not trained (the glm5_next family's KPool indexer is)")
    indexer_weight = float(t.get("indexer_loss_weight", 0.0))
    if not base:
        target, mtp, params = build_models(mcfg, t.seed)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(t.seed)
    eval_windows = sample_windows(corpus.heldout, t.eval_windows, t.seq_len + 1,
                                  torch.Generator().manual_seed(t.seed + 7))
    log = make_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="train",
                      group=cfg.get("group"))
    setup_s = time.perf_counter() - t0
    print(f"corpus: {corpus.train.numel()} train / {corpus.heldout.numel()} held-out tokens, vocab "
          f"{corpus.tokenizer.vocab_size}, setup {setup_s:.0f}s, "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M parameters")

    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    load = ExpertLoad()
    moe = partial(grouped_moe, load=load)
    # The budget covers the whole run: stop training a minute early for the last eval and saving.
    deadline = t0 + 60 * (t.max_minutes - 1)
    bar = tqdm(range(t.steps), desc="train", dynamic_ncols=True, mininterval=5)
    step = 0
    for step in bar:
        lr = lr_at(step, t.steps, t.lr, t.min_lr, t.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_windows(corpus.train, t.batch_size, t.seq_len + 1, gen)
        tot_t, tot_m, accs = 0.0, [0.0] * t.mtp_depth, [0.0] * t.mtp_depth
        tot_ix, tot_recall = 0.0, 0.0
        opt.zero_grad(set_to_none=True)
        for window in batch:
            ls = sequence_losses(target, mtp, window, t.mtp_depth, moe, t.mtp_distill)
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
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing: nudge biases toward under-loaded experts
            for m in moe_layers(target, mtp, frozen_target=bool(base)):
                c = load.counts.get(id(m.router))
                if c is not None:
                    m.e_score_correction_bias += t.bias_update_rate * torch.sign(c.float().mean() - c.float())
        load.counts.clear()
        rec = {"step": step, "lr": lr, "grad_norm": gnorm, "target_loss": tot_t,
               **{f"mtp{k + 1}_loss": tot_m[k] for k in range(t.mtp_depth)},
               **{f"mtp{k + 1}_acc": accs[k] for k in range(t.mtp_depth)}}
        if mcfg.is_next:
            rec.update(indexer_kl=tot_ix, indexer_recall=tot_recall)
        history.append(rec)
        bar.set_postfix(loss=f"{tot_t:.3f}", mtp1=f"{tot_m[0]:.3f}", acc1=f"{accs[0]:.2f}")
        if step % t.log_every == 0:
            log.log({f"train/{k}": v for k, v in rec.items() if k != "step"}, step=step)
        last = step == t.steps - 1 or time.perf_counter() >= deadline
        if step % t.eval_every == 0 or last:
            ev = {"step": step, **evaluate(target, mtp, eval_windows, t.mtp_depth)}
            evals.append(ev)
            log.log({f"heldout/{k}": v for k, v in ev.items() if k != "step"}, step=step)
            tqdm.write(f"step {step}: held-out target {ev['target_loss']:.3f} mtp1 {ev['mtp1_loss']:.3f} acc1 "
                       f"{ev['mtp1_acc']:.3f}")
        if last:
            if step < t.steps - 1:
                tqdm.write(f"stopping at step {step}: the train.max_minutes={t.max_minutes} budget is spent")
            break
    bar.close()
    minutes = (time.perf_counter() - t0) / 60
    recent = history[-t.log_every:]
    final = {**evals[-1], "train_target_loss": sum(h["target_loss"] for h in recent) / len(recent),
             "train_mtp1_loss": sum(h["mtp1_loss"] for h in recent) / len(recent), "minutes": minutes,
             "steps": step + 1}
    png = os.path.join(run_dir, "loss_curve.png")
    plot_curves(history, evals, png)
    log.log_image("loss_curve", png)
    from .provenance import git_commit

    log.summary({**{f"final/{k}": v for k, v in final.items()}, "corpus_sha256": corpus.split.digest(),
                 "git_commit": git_commit()})
    log.finish()
    with open(os.path.join(run_dir, "final.json"), "w") as f:
        json.dump(final, f, indent=1)
    print(json.dumps(final, indent=1))
    if cfg.out:
        card = model_card(cfg, mcfg, corpus, final, minutes, step + 1, command)
        save_trained_model(cfg.out, target, mtp, corpus, card,
                           {"training_log.json": {"history": history, "evals": evals, "final": final}})
        import shutil

        shutil.copy(png, os.path.join(cfg.out, "loss_curve.png"))
        print(f"checkpoint written to {cfg.out}")
    return final


def main() -> None:
    from .entry import command_line, hydra_main
    from .validate import check_train

    prog = "python -m glm_mtp.experiments.train"
    hydra_main("train", prog, check_train, lambda cfg, hc: run(cfg, hc.runtime.output_dir, command_line(prog, hc)))


if __name__ == "__main__":
    main()
