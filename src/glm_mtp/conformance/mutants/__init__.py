"""The mutants' registry: every mutant the suite must catch, by name (``mutant:<name>`` on the
command line).

The mutants are reference drafters that each break one rule (``base``), grouped by what they
break: ``rows`` (a call's rows, counters and refusals), ``block`` (what a row computes),
``batch`` (batched calls), ``kpool`` (the KPool indexer), ``sharing`` (index sharing across draft
steps, DESIGN.md §9).

To add one: subclass ``Mutant`` (or ``SwappingMutant`` and return the swaps from ``swaps``) in
the module of what it breaks, set ``name`` and ``rule``, and add the class to that module's
``MUTANTS`` tuple. A new group is a module ``mutants/<what>.py`` with its own ``MUTANTS`` tuple,
imported below and added to ``GROUPS``. The test in ``tests/conformance/test_mutants.py`` then
demands the suite catch every one. Add a mutant whenever a rule is added to the spec.
"""

from __future__ import annotations

from . import batch, block, kpool, rows, sharing
from .base import Mutant

# Every module of mutants. A new group is one import above and one entry here.
GROUPS = (rows, block, batch, kpool, sharing)

# The registry: name -> class. Every entry must be caught by the suite (tests/conformance).
MUTANTS: dict[str, type[Mutant]] = {cls.name: cls for group in GROUPS for cls in group.MUTANTS}
