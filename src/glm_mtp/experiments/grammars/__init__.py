"""Grammars for constrained output (DESIGN.md §10), compiled with xgrammar (the ``grammar`` extra).

- ``spec``: which grammar a run uses (the ``grammar`` config group, ``source=jsonl`` lines'
  ``json_schema``), its identity (kind, sha256 of its text) and the syntax check run before any
  work;
- ``compile``: xgrammar's ``TokenizerInfo`` from the package's BPE or transformers' tokenizer,
  compiled grammars and fresh matchers.

The loop's use of a matcher (masked verification, the matcher advanced on committed tokens) is
``experiments.loop.grammar_verify``'s. Importing this package does not import xgrammar.
"""

from .spec import GRAMMAR_DRAFTS, GRAMMAR_KINDS, GrammarSpec, check_syntax, jsonl_schemas, prompt_schema, run_grammar

__all__ = ["GRAMMAR_DRAFTS", "GRAMMAR_KINDS", "GrammarSpec", "check_syntax", "jsonl_schemas", "prompt_schema",
           "run_grammar"]
