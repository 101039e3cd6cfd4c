"""What one acceptance run measured, before any statistics (``Measurement``), and the record of
the target that verified it (``target_record``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..loop.speculative import SpecStats
from ..targets.checkpoint import LoadedModel
from ..targets.target import class_path
from .run_grammars import RunGrammars


@dataclass(kw_only=True)
class Measurement:
    """What one acceptance run measured, before any statistics: the pooled and per-prompt counts
    of the loop (or of teacher forcing), the generated text's 4-gram counts, the prompts whose
    greedy output parted from the target's own (``check_lossless``), two samples, the time, and
    (glm5_next, reference backend) the drafter's selection and each drafted row's recall. Built
    by keywords only.

    Args:
        mode: ``speculative`` | ``teacher_forced``.
        source: where the prompts came from (``heldout`` | ``ood`` | ``text`` | ``jsonl``; a
            replay: its trace's).
        batch_size: prompts per ``propose_batch``.
        draft: ``argmax`` | ``sampled``.
        numerics: the target's numerics (``vendor`` | ``pinned`` | ``transformers`` | a trace's).
        model: the loaded checkpoint.
        target: the target that verified (``Target``, ``HfTarget`` or ``ReplayTarget``).
        proposer: the drafter without the recall recording (the speedup model times it).
        windows: each prompt's token ids (prompt and the text after it).
        stats: the pooled counts; per_prompt: each prompt's.
        generated: tokens the loop generated (0 in teacher forcing).
        grams, distinct: 4-grams within each generation, and the distinct ones.
        check_lossless: whether each prompt was also decoded by the target alone.
        divergences: per parting prompt, its index and first differing generated token.
        samples: up to two prompts with their continuations, decoded.
        wall: seconds the loop took.
        attention: ``sparse`` | ``dense``.
        recall: per drafted row (``experiments.loop.recall``); None without a KPool probe.
        grammars: the prompts' grammars (DESIGN.md §10); None without any.
        outputs_sha256: of every prompt's generated tokens (speculative mode).
        trace: the replayed trace (``traces.format.Trace``); None for a live target.
    """

    mode: str
    source: str
    batch_size: int
    draft: str
    numerics: str
    model: LoadedModel
    target: Any  # Target, HfTarget for model=hf, ReplayTarget for a trace
    proposer: Any
    windows: list[list[int]]
    stats: SpecStats
    per_prompt: list[SpecStats]
    generated: int
    grams: int
    distinct: int
    check_lossless: bool
    divergences: list[dict[str, int]]
    samples: list[dict[str, Any]]
    wall: float
    attention: str = "sparse"
    recall: list[dict[str, float]] | None = None
    grammars: RunGrammars | None = None
    outputs_sha256: str | None = None
    trace: Any = None


def target_record(m: Measurement) -> dict[str, Any]:
    """What the target was: the trace's record for a replay, transformers' model (version, class,
    config sha256, device map, dtype, top-k ties) or the package's own (its class and numerics)."""
    if m.trace is not None:
        return m.trace.meta["target"]
    if m.model.hf is not None:
        return {**m.model.hf.info, "topk_ties": m.target.topk_ties}
    return {"implementation": class_path(m.target), "numerics": m.numerics}
