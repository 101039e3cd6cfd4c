"""The mutants' base: reference drafters that each break one rule, to prove the suite can fail.

Each mutant subclasses ``ReferenceProposer`` and breaks exactly one rule of DESIGN.md, by
overriding a method (a copy of the reference's with the one change) or, where the rule lives in
a plain function deep in the block, by swapping that function in for the duration of the
mutant's own calls only (``swapped``): the swap is undone before the call returns. The lockstep
runs its two sides one after the other, so a reference beside a mutant in the same process never
runs while a swap is in place (the lock serialises mutants among themselves; a reference running
in another thread at the same moment is not protected, so do not thread a mutant run).

The mutants themselves live in this package's other modules (``block``, ``rows``, ``kpool``,
``sharing``, ``grammar``, ``confidence``, ``batch``), grouped by what they break; the package's
``__init__`` is the registry (``mutants.MUTANTS``, ``mutants.GROUPS``).
"""

from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any, Callable, ClassVar, Iterator

from glm_mtp.reference.proposer import ReferenceProposer
from glm_mtp.reference.state import DrafterState

from ..scenarios import GENERATORS


_SWAP_LOCK = threading.RLock()


@contextmanager
def swapped(module: ModuleType, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``module.name`` is ``replacement`` inside the block and the original again after it."""
    with _SWAP_LOCK:
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            yield
        finally:
            setattr(module, name, original)


class Mutant(ReferenceProposer):
    """A reference drafter that breaks one rule.

    Class attributes:
        name: the registry key (``mutant:<name>`` on the command line).
        rule: the rule it breaks, one line.
        generators: the generators whose scenarios reach the rule (the batched calls' mutants
            need ``batched``).
        preset: the config preset whose drafter has the rule (the KPool mutants need a
            glm5_next one).
    """

    name: ClassVar[str]
    rule: ClassVar[str]
    generators: ClassVar[tuple[str, ...]] = GENERATORS
    preset: ClassVar[str] = "tiny"


class SwappingMutant(Mutant):
    """A mutant whose bug is a swapped reference function, active only during its own calls."""

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        raise NotImplementedError

    def _swapped(self, state: DrafterState, call: Callable[[], Any]) -> Any:
        with ExitStack() as stack:
            if isinstance(state, DrafterState) and not state.released:
                for module, name, fn in self.swaps(state):
                    stack.enter_context(swapped(module, name, fn))
            return call()

    def prefill_drafter(self, prompt_tokens, hiddens, state):
        return self._swapped(state, lambda: super(SwappingMutant, self).prefill_drafter(prompt_tokens, hiddens, state))

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):
        return self._swapped(
            state, lambda: super(SwappingMutant, self).catchup_drafter(tokens, hiddens, row_base, pos_base, state)
        )

    def propose(self, last_token, target_hidden, position, num_drafts, state, grammar=None):
        return self._swapped(
            state, lambda: super(SwappingMutant, self).propose(last_token, target_hidden, position, num_drafts, state,
                                                               grammar=grammar)
        )

    def propose_sampled(self, last_token, target_hidden, position, num_drafts, temperature, noise, state,
                        grammar=None):
        return self._swapped(
            state, lambda: super(SwappingMutant, self).propose_sampled(last_token, target_hidden, position, num_drafts,
                                                                       temperature, noise, state, grammar=grammar)
        )
