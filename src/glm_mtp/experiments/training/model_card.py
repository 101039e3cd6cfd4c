"""The trained checkpoint's README (its model card): templates with named fields, filled by
``model_card`` from the run's settings, the model's config, the corpus and the final losses."""

from __future__ import annotations

import math
import os
import sys
from string import Template
from typing import Any

import torch

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.weights import mtp_tensor_shapes

from . import corpus as corpus_mod
from ..targets.target import target_tensor_shapes
from .corpus import Corpus

CARD = Template("""$title

Trained by this package on the Python standard library, so acceptance-rate numbers can be
re-derived on any machine. $architecture

## Command

```
$command
```

($steps steps of $batch_size x $seq_len tokens, $minutes minutes with $threads CPU thread(s), torch $torch,
Python $python; seed $seed; MTP loss weight $mtp_loss_weight, MTP unrolled $mtp_depth times with shared
weights, self-distillation share $mtp_distill.)$stopped$based

Reproducible: the learning rate is a function of the step alone (linear warm-up over $warmup steps,
cosine from $lr to $min_lr at step $total_steps, `training_log.json` holds the rate of every step),
windows are drawn from a generator seeded with the seed, and torch runs `train.threads` = $threads
thread(s) (set by the command: the reductions' order depends on the thread count). So the same
command on the same Python and torch gives a byte-identical `model.safetensors`; checked on short
runs by $repro_test.

## Data

- Corpus: the `.py` files of the Python $python standard library (tests, idlelib, turtledemo,
  lib2to3, ensurepip, site-packages excluded) and the `pydoc_data.topics` texts.
- Held-out: candidates are the items whose blake2b path hash falls in the $heldout_percent% bucket; a
  candidate stays held out only if at most $max_overlap of its distinct lines of $min_line_chars+ characters and
  at most $max_overlap of its distinct $ngram-word n-grams occur in training items (else it moves to
  training, repeated until none moves). Listed in `corpus.json` ($n_heldout held out, $n_train for training).
  Measured after the fix: at most $max_lines of a held-out item's long lines and $max_grams of its n-grams \
occur in training.
- Corpus file-list sha256: `$digest`
- Tokenizer: byte-level BPE, $vocab_size tokens, trained on the training split (`tokenizer.json`,
  `glm_mtp.experiments.training.bpe.BpeTokenizer.load`)$reused. \
Training stream $train_tokens tokens, held-out $heldout_tokens.

## Final losses (nats; held-out over $eval_windows fixed windows of $seq_len tokens)

| | target | MTP depth 1 | MTP depth 1 top-1 acc |$depth2_head
|---|---|---|---|$depth2_rule
| held-out | $target_loss | $mtp1_loss | $mtp1_acc |$depth2_value
| train (last $log_every steps) | $train_target_loss | $train_mtp1_loss | | |

The loss curves are in `loss_curve.png`, every logged step in `training_log.json`.

## Load

```python
from glm_mtp.reference import MtpWeights
from glm_mtp.experiments.targets.target import TargetWeights
mtp = MtpWeights.from_pretrained(dir)        # the MTP layer + embedding + head
target = TargetWeights.from_pretrained(dir)  # the target's layers
```

$indexer
""")

GLM5_TITLE = "# glm5-mtp-stdlib: a small GLM-5-architecture target with its MTP layer"

GLM5_ARCHITECTURE = Template("""Architecture: GLM-5 (`glm_moe_dsa`) at toy scale: $layers decoder
layers (the first $dense dense), DSA attention (MLA + lightning indexer), sigmoid-routed MoE
($experts experts, $per_token per token, 1 shared), and one MTP layer at `model.layers.$layers`.
$sizes""")

NEXT_TITLE = Template("# $name: a small target with GLM-5.3-Flash's MTP layer (glm5_next family)")

NEXT_ARCHITECTURE = Template("""Architecture: the glm5_next family (DESIGN.md §7) at toy scale: $layers decoder layers
(the first $dense dense), each with GLM-5.3-Flash's DSA attention (NoPE MLA, qk_nope $qk_nope, no RoPE; KPool
indexer, `index_kpool` $kpool, `index_topk` $topk: $pools pools of $kpool rows plus the row's own
incomplete pool), sigmoid-routed MoE ($experts experts, $per_token per token, 1 shared) with the SwiGLU \
clamped at `swiglu_limit` $limit,
and one MTP layer at `$prefix` (a plain pre-norm block, as in GLM-5.3-Flash).
$sizes

Left out of GLM-5.3-Flash: its decoder's Kimi Delta Attention layers (the target here is DSA
layers only), the mHC hyper-connections (plain residuals here), the vision tower, the fp8
weights and the real widths; the MTP layer's structure is the release's (its config reads back as
`model_type: glm5_next`).""")

GLM5_INDEXER = Template("""The lightning indexer is not trained (training windows fit in `index_topk` = $topk \
rows, so DSA
attends to every visible row); keep contexts within $topk rows.""")

NEXT_INDEXER = Template("""## The KPool indexer: trained

Training windows of $seq_len tokens are ${ratio}x `index_topk` = $topk, so selection is real. Every
layer (the target's $layers and the MTP layer) attends through the KPool selection in the training
forward, as at inference (torch's kernels, `kpool.kpool_rows` with `ops=VENDOR`); the selection is
discrete, so the language-model losses never reach the indexer. The indexer is trained end to end
alongside the model by its own loss, DSA's sparse-stage indexer KL (DeepSeek-V3.2) aggregated to
pools: for each row with at least two candidate pools, KL(dense attention mass per candidate pool,
head-averaged, detached and renormalised || softmax of the indexer's pool scores), weight
`train.indexer_loss_weight` = $weight. The indexer's inputs are detached (its queries, head
weights, gates and keys are recomputed from the detached layer input), so that KL trains the
indexer (`wq_b`, `wk`, `k_norm`, `weights_proj`, the KPool gate and `ape`) and nothing else
(`experiments/training/indexer_loss.py`). No dense warm-up stage: the indexer starts random.

Held-out at the end: indexer KL $kl nats per scored row, mean recall $recall
(the share of the dense head-averaged attention mass on the selected rows, every row of the
$eval_windows windows and every layer).""")


def model_card(cfg: Any, mcfg: MtpConfig, corpus: Corpus, final: dict[str, float], minutes: float, steps: int,
               command: str) -> str:
    """The checkpoint's README."""
    n_params = sum(math.prod(s) for s in target_tensor_shapes(mcfg).values())
    n_mtp = sum(math.prod(s) for s in mtp_tensor_shapes(mcfg).values())
    title, architecture = card_architecture(cfg, mcfg, n_params, n_mtp)
    return CARD.substitute(title=title, architecture=architecture, command=command,
                           indexer=card_indexer(cfg, mcfg, final),
                           **card_run(cfg, steps, minutes), **card_data(cfg, corpus), **card_losses(cfg, final),
                           repro_test=card_repro_test(mcfg))


def card_run(cfg: Any, steps: int, minutes: float) -> dict[str, Any]:
    """The run's schedule and environment, and how it ended (stopped early, or on a base)."""
    t = cfg.train
    based = (f"\n\nBase: the target, embedding, head and tokenizer of `train.base={t.base}`, frozen; only the MTP "
             "layer was trained (from a random start), so the target losses below are the base's."
             if t.get("base") else "")
    stopped = ("" if steps == t.steps else
               f"\nStopped by `train.max_minutes` at step {steps} of {t.steps}: the schedule did not finish.")
    return dict(steps=steps, batch_size=t.batch_size, seq_len=t.seq_len, minutes=f"{minutes:.1f}", threads=t.threads,
                torch=torch.__version__, python=".".join(map(str, sys.version_info[:3])), seed=t.seed,
                mtp_loss_weight=t.mtp_loss_weight, mtp_depth=t.mtp_depth, mtp_distill=t.mtp_distill, stopped=stopped,
                based=based, warmup=t.warmup, lr=f"{t.lr:g}", min_lr=f"{t.min_lr:g}", total_steps=t.steps)


def card_repro_test(mcfg: MtpConfig) -> str:
    """The test that checks the run reproduces byte for byte."""
    if mcfg.is_next:
        return "`tests/experiments/test_train_next.py` (sha256 of the written files, twice; another seed differs)"
    return ("`tests/experiments/test_train_repro.py` (sha256 of the written files, one run on a clock\n"
            "a thousand times slower)")


def card_data(cfg: Any, corpus: Corpus) -> dict[str, Any]:
    """The corpus, its held-out split and its measured overlap, the tokenizer."""
    ov = [o for n, o in corpus.split.overlap.items() if n in corpus.split.heldout]
    tok_path = cfg.tokenizer.get("path")
    reused = (f"; reused from `tokenizer.path={tok_path}` (the same split, checked by its sha256), not retrained"
              if tok_path else "")
    return dict(heldout_percent=corpus_mod.HELDOUT_PERCENT, max_overlap=f"{corpus_mod.MAX_OVERLAP:.0%}",
                min_line_chars=corpus_mod.MIN_LINE_CHARS, ngram=corpus_mod.NGRAM, n_heldout=len(corpus.split.heldout),
                n_train=len(corpus.split.train), max_lines=f"{max((o.lines for o in ov), default=0.0):.1%}",
                max_grams=f"{max((o.ngrams for o in ov), default=0.0):.1%}", digest=corpus.split.digest(),
                vocab_size=corpus.tokenizer.vocab_size, reused=reused, train_tokens=corpus.train.numel(),
                heldout_tokens=corpus.heldout.numel())


def card_losses(cfg: Any, final: dict[str, float]) -> dict[str, Any]:
    """The final losses table (a depth-2 column when the MTP layer was unrolled twice or more)."""
    t = cfg.train
    deep = t.mtp_depth >= 2
    return dict(eval_windows=t.eval_windows, log_every=t.log_every, target_loss=f"{final['target_loss']:.4f}",
                mtp1_loss=f"{final['mtp1_loss']:.4f}", mtp1_acc=f"{final['mtp1_acc']:.4f}",
                train_target_loss=f"{final['train_target_loss']:.4f}",
                train_mtp1_loss=f"{final['train_mtp1_loss']:.4f}",
                depth2_head=" MTP depth 2 |" if deep else "", depth2_rule="---|" if deep else "",
                depth2_value=f" {final['mtp2_loss']:.4f} |" if deep else "")


def card_architecture(cfg: Any, mcfg: MtpConfig, n_params: int, n_mtp: int) -> tuple[str, str]:
    """The model card's title and architecture paragraph, by family."""
    sizes = (f"Target {n_params / 1e6:.2f} M parameters (embedding and head included), "
             f"MTP layer {n_mtp / 1e6:.2f} M. float32.")
    common = dict(layers=mcfg.num_hidden_layers, dense=mcfg.first_k_dense_replace, experts=mcfg.n_routed_experts,
                  per_token=mcfg.num_experts_per_tok, sizes=sizes)
    if not mcfg.is_next:
        return GLM5_TITLE, GLM5_ARCHITECTURE.substitute(common)
    name = os.path.basename(os.path.normpath(cfg.out)) if cfg.get("out") else "glm5next-mtp"
    return NEXT_TITLE.substitute(name=name), NEXT_ARCHITECTURE.substitute(
        common, qk_nope=mcfg.qk_nope_head_dim, kpool=mcfg.index_kpool, topk=mcfg.index_topk,
        pools=mcfg.kpool_pools_selected,
        limit=f"{mcfg.swiglu_limit:g}", prefix=mcfg.layer_prefix.rstrip("."))


def card_indexer(cfg: Any, mcfg: MtpConfig, final: dict[str, float]) -> str:
    """The model card's paragraph on the indexer: untrained (GLM-5: keep contexts within
    ``index_topk``) or trained (glm5_next: how, and its held-out KL and recall)."""
    t = cfg.train
    if not mcfg.is_next:
        return GLM5_INDEXER.substitute(topk=mcfg.index_topk)
    return NEXT_INDEXER.substitute(seq_len=t.seq_len, ratio=f"{t.seq_len / mcfg.index_topk:g}", topk=mcfg.index_topk,
                                   layers=mcfg.num_hidden_layers, weight=t.get("indexer_loss_weight", 0.0),
                                   kl=f"{final.get('indexer_kl', float('nan')):.4f}",
                                   recall=f"{final.get('indexer_recall', float('nan')):.4f}",
                                   eval_windows=t.eval_windows)
