"""The grammars of a run's prompts (DESIGN.md §10): the run's one grammar for every prompt, or
each ``source=jsonl`` line's ``json_schema``, compiled against the model's vocabulary before the
loop starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..grammars import jsonl_schemas, run_grammar
from ..loop.round import GrammarDrafts
from ..settings.prompts import prompts_path
from ..targets.checkpoint import LoadedModel


@dataclass
class RunGrammars:
    """The grammars of a run's prompts (``experiments.grammars``): the run's one grammar
    (``grammar=KIND``) for every prompt, or each ``source=jsonl`` line's ``json_schema`` (None for
    lines without one), compiled against the model's vocabulary.

    Args:
        specs: one ``GrammarSpec`` or None per prompt.
        run_spec: the run's grammar, None for per-prompt schemas.
        drafts: ``masked`` | ``unmasked`` (``grammar.drafts``).
        compiler: a ``grammars.compile.GrammarCompiler`` for the model's tokenizer.
    """

    specs: list[Any]
    run_spec: Any
    drafts: GrammarDrafts
    compiler: Any

    def matcher(self, i: int) -> Any:
        """A fresh matcher of prompt ``i``'s grammar, or None when it has none."""
        spec = self.specs[i]
        return None if spec is None else self.compiler.matcher(spec)

    def record(self) -> dict[str, Any]:
        """summary.json's ``grammar``: kind, sha256 of the text and origin of the run's grammar,
        or, for per-prompt schemas, each prompt's sha256 (null where a prompt has none)."""
        if self.run_spec is not None:
            return {**self.run_spec.record(), "drafts": self.drafts}
        return {"kind": "json_schema", "origin": "per_prompt", "drafts": self.drafts,
                "sha256": [None if s is None else s.sha256 for s in self.specs]}


def run_grammars(cfg: Any, model: LoadedModel, num_prompts: int) -> RunGrammars | None:
    """The run's grammars, compiled for the model's tokenizer; None when no prompt has one.

    Args:
        cfg: the run's config (its ``grammar`` group; ``source=jsonl`` lines' ``json_schema``).
        model: the loaded checkpoint (its tokenizer and vocabulary size).
        num_prompts: how many prompts the run has.
    """
    node = cfg.get("grammar")
    spec = run_grammar(node)
    specs: list[Any] = [spec] * num_prompts
    path = prompts_path(cfg)
    if spec is None and cfg.get("source") == "jsonl" and path is not None:  # validation required the path
        specs = jsonl_schemas(path, num_prompts)
    if all(s is None for s in specs):
        return None
    if model.tokenizer is None:
        raise ValueError("a grammar is compiled against the model's tokenizer; this model has none")
    from ..grammars.compile import GrammarCompiler  # imports xgrammar (the grammar extra)

    compiler = GrammarCompiler(model.tokenizer, model.mtp.config.vocab_size)
    for s in specs:
        if s is not None:
            compiler.compile(s)  # every grammar compiles before the loop starts
    return RunGrammars(specs, spec, node.get("drafts", "masked"), compiler)  # grammar.drafts checked by validation
