"""The mutants' registry: every mutant the suite must catch, by name (``mutant:<name>`` on the
command line).

The mutants are reference drafters that each break one rule (``mutants_base``), grouped by what
they break: ``mutants_rows`` (a call's rows, counters and refusals), ``mutants_block`` (what a
row computes), ``mutants_batch`` (batched calls), ``mutants_kpool`` (the KPool indexer),
``mutants_sharing`` (index sharing across draft steps, DESIGN.md §9).

To add one: subclass ``Mutant`` (or ``SwappingMutant`` and return the swaps from ``swaps``) in
the module of what it breaks, set ``name`` and ``rule``, and add the class to that module's
``MUTANTS`` tuple. A new group is a module ``mutants_<what>.py`` with its own ``MUTANTS`` tuple,
imported below and added to ``GROUPS``. The test in ``tests/conformance/test_mutants.py`` then
demands the suite catch every one. Add a mutant whenever a rule is added to the spec.
"""

from __future__ import annotations

from . import mutants_batch, mutants_block, mutants_kpool, mutants_rows, mutants_sharing
from .mutants_base import Mutant

# Every module of mutants. A new group is one import above and one entry here.
GROUPS = (mutants_rows, mutants_block, mutants_batch, mutants_kpool, mutants_sharing)

# The registry: name -> class. Every entry must be caught by the suite (tests/conformance).
MUTANTS: dict[str, type[Mutant]] = {cls.name: cls for group in GROUPS for cls in group.MUTANTS}
