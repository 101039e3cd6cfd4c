"""The adversarial generator as a hypothesis ``RuleBasedStateMachine``.

Each rule of ``single_state.RULES`` (alloc, free, prefill, catch-up, propose, verify, a well-formed
round, a long prompt) becomes a machine rule whose choices hypothesis draws, so hypothesis
explores misuse and odd orders and, on a difference, shrinks the call sequence to a short one.
Every op runs in lockstep on both backends at once, with the same checks as ``run``.

    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    from glm_mtp.conformance.machines.machine import lockstep_machine
    run_state_machine_as_test(lockstep_machine("optimized", "reference"), settings=settings(max_examples=50,
    deadline=None))

The seeded walk in ``single_state.adversarial`` uses the same rules; it is what ``run`` and the CLI
replay by (seed, index). On a difference the machine saves the failing call sequence as JSON
(under ``$GLM_MTP_CONFORMANCE_DIR``, else the temp dir) and its message ends with a
``--scenario-file`` command that replays it.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, Callable, Sequence, TypeVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from ..backends import Factory
from ..lockstep import Harness
from ..choices import Chooser
from ..runner import replay_command
from ..scenarios import GENERATORS, MAX_DRAFTS, save_scenario
from ..single_state import RULES
from ..ops import Op
from ..spec import SpecModel

T = TypeVar("T")


class HypothesisChooser:
    """Choices drawn from hypothesis data; they shrink toward the first option, the low end and
    "no" (so toward valid, simple calls)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return self.data.draw(st.sampled_from(list(options)))

    def chance(self, p: float) -> bool:
        return self.data.draw(st.integers(0, 999)) >= 1000 - round(p * 1000)

    def seed(self) -> int:
        return self.data.draw(st.integers(0, 2**31 - 1))


def lockstep_machine(
    candidate: str | Factory = "reference",
    baseline: str | Factory = "reference",
    preset: str = "tiny",
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    max_seq_len: int = 64,
    weights_seed: int = 0,
    max_drafts: int = MAX_DRAFTS,
    grammars: bool | None = None,
) -> type[RuleBasedStateMachine]:
    """A machine class that plays hypothesis-chosen rules on ``candidate`` and ``baseline``.

    Args:
        candidate, baseline: backend specs (see ``backends.resolve_backend``).
        preset, dtype, device, max_seq_len, weights_seed: as in ``run``; the weights are built
            once for every example the machine runs.
        max_drafts: the largest ``num_drafts`` of a valid propose.
        grammars: draw grammars and sampled proposes and compare confidences (DESIGN.md §10,
            §12; ``Harness.grammars``: None when both backends take them).
    """
    harness = Harness(candidate, baseline, preset, dtype, device, max_seq_len, weights_seed, grammars)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{harness.candidate_name}-vs-{harness.baseline_name}")
    path = os.path.join(os.environ.get("GLM_MTP_CONFORMANCE_DIR", tempfile.gettempdir()),
                        f"glm-mtp-machine-{name}.json")

    def __init__(self: Any) -> None:
        RuleBasedStateMachine.__init__(self)
        self.ops: list[Op] = []

    def start(self: Any, share: bool) -> None:
        # Index sharing (DESIGN.md §9) on or off for both sides, drawn per example as the seeded
        # generators draw it per scenario (shrinks toward off).
        self.share = share
        self.lockstep = harness.lockstep(share)
        self.model = SpecModel(harness.config, max_seq_len, share, bool(harness.grammars))
        self.play([self.model.info(), self.model.alloc()])

    def play(self: Any, ops: list[Op]) -> None:
        for op in ops:
            self.ops.append(op)
            finding = self.lockstep.step(op)
            if finding is not None:
                calls = "\n".join(f"  {i:3d}  {o.call()}  [spec: {o.expect}]" for i, o in enumerate(self.ops))
                # Hypothesis replays the shrunk example last, so the file ends up holding it.
                save_scenario(path, self.ops, origin="glm_mtp.conformance.machines.machine", index_share=self.share)
                replay = replay_command(harness, 0, 0, GENERATORS, max_drafts, scenario_file=path)
                raise AssertionError(
                    f"{harness.candidate_name} vs {harness.baseline_name} differ at step {len(self.ops) - 1}: "
                    f"{op.call()}\n  {finding.where()}: {finding.detail}\n  candidate: {finding.candidate}\n  "
                    f"baseline:  {finding.baseline}\ncalls so far:\n{calls}\n  replay: {replay}"
                )

    def make_rule(fn: Callable[[Chooser, SpecModel, int], list[Op]]) -> Callable[..., None]:
        def step(self: Any, data: Any) -> None:
            self.play(fn(HypothesisChooser(data), self.model, max_drafts))

        step.__name__ = fn.__name__
        return rule(data=st.data())(step)

    body: dict[str, Any] = {"__init__": __init__, "start": initialize(share=st.booleans())(start), "play": play}
    body.update({name: make_rule(fn) for name, (fn, _) in RULES.items()})
    return type("LockstepMachine", (RuleBasedStateMachine,), body)
