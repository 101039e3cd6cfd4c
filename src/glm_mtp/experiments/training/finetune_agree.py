"""Fine-tuning's check, before any training, that its forward is the drafter's (DESIGN.md §13):
the gradients it follows are those of the head the replay (and a serving engine) runs only if
``mtp_train_forward.drafter_forward`` computes what the reference drafter computes, for this
checkpoint's family, attention, sparse selection, index sharing and ``finetune.feed_hidden``.

On the first ``ROWS`` positions of one trace item (the first training item): the reference
drafter (``ReferenceProposer``) proposes at every row p after a fresh prefill of rows ``[0, p)``,
``d = 1 .. depth`` drafts, and its post-norm output ``x`` of draft step d (``state.x``) is kept;
``drafter_forward`` under pinned numerics with gradients off, fed the reference's own drafts at
depths > 1, must give the same bytes at every (depth, row) (``reference.bytes.same_bytes``; the
logits are ``lm_head`` of ``x``, so equal ``x`` is equal logits). A difference is a
``ForwardDisagreement`` (a ``ValueError``) naming the item, the depth, the row and how many values
differ: the entry point prints it as one line and exits 2, nothing written. Training then runs
torch's kernels on the same computation (rounding in another order, bounded in
tests/experiments/test_mtp_train_forward.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.contract import FeedHidden
from glm_mtp.reference.weights import MtpWeights

from ..traces.format import TraceItem
from .mtp_train_forward import PINNED, drafter_forward

ROWS = 8  # positions of the item checked: every depth's rows of a short item, a few seconds on a real layer


class ForwardDisagreement(ValueError):
    """The training forward and the reference drafter differ (module docstring)."""


def reference_outputs(w: MtpWeights, tokens: Tensor, hiddens: Tensor, depth: int, feed_hidden: FeedHidden
                      ) -> tuple[list[list[Tensor]], list[list[int]]]:
    """Per row p of ``tokens`` (n,) / ``hiddens`` (n, H): the reference drafter's ``x`` (H,) of
    draft steps ``1 .. min(depth, n - 1 - p)`` proposing at p after a prefill of ``tokens[: p + 1]``,
    and its drafts."""
    from glm_mtp.reference import ReferenceProposer

    n = tokens.shape[0]
    proposer = ReferenceProposer(w, n + depth + 1, feed_hidden=feed_hidden)
    xs, drafts = [], []
    for p in range(n - 1):
        k = min(depth, n - 1 - p)
        state = proposer.alloc_state(hiddens.device)
        proposer.prefill_drafter(tokens[: p + 1].tolist(), hiddens[: p + 1], state)
        row = []
        for d in range(1, k + 1):  # step d's x is the last of a d-draft propose; each rewinds to row p first
            got = proposer.propose(int(tokens[p + 1]), hiddens[p : p + 1], p, d, state)
            assert state.x is not None  # every propose sets it
            row.append(state.x.clone())
            proposer.after_verify(0, state)
        drafts.append(got)
        proposer.free_state(state)
        xs.append(row)
    return xs, drafts


@torch.no_grad()
def check_forward_agrees(w: MtpWeights, item: TraceItem, index: int, depth: int, feed_hidden: FeedHidden,
                         rows: int = ROWS) -> None:
    """Raise ``ForwardDisagreement`` unless ``drafter_forward`` (pinned) gives the reference
    drafter's bytes on item ``index`` (``item``)'s first ``rows`` positions at depths
    ``1 .. depth`` (module docstring). ``w``: the weights training starts from (fp32)."""
    n = min(item.length, rows)
    depth = min(depth, n - 1)
    tokens, hiddens = item.tokens[:n].long(), item.hidden[:n].to(w.dtype)
    want, drafts = reference_outputs(w, tokens, hiddens, depth, feed_hidden)
    chain = lambda d, P: torch.tensor([drafts[p][d - 2] for p in range(P)])  # noqa: E731  (the reference's own drafts)
    outs = drafter_forward(w, tokens, hiddens, depth, ops=PINNED, feed_hidden=feed_hidden, chain=chain)
    for d, out in enumerate(outs, start=1):
        for p in range(out.x.shape[0]):
            got, ref = out.x[p], want[p][d - 1]
            if not same_bytes(got, ref):
                odd = int((got != ref).sum())
                raise ForwardDisagreement(
                    f"finetune's training forward (mtp_train_forward.drafter_forward, pinned) disagrees with the "
                    f"reference drafter on trace item {index}, depth {d}, row {p}: {odd} of {got.numel()} values of "
                    f"the post-norm output differ (max |difference| {float((got - ref).abs().max()):.3e}); its "
                    "gradients would not be the drafter's, so it does not train")
