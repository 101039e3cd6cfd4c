"""The conformance suite: does a drafter backend equal the reference bit for bit?

    from glm_mtp.conformance import run
    report = run("optimized", "reference", scenarios=200, seed=0, device="cpu")
    assert report.ok, report.first_difference

or ``python -m glm_mtp.conformance --candidate optimized --baseline reference``. Only torch (and
the reference) is needed to import it; hypothesis only for ``machines/``
(``from glm_mtp.conformance.machines.machine import lockstep_machine``); no Hydra, no W&B.

It checks either family (GLM-5, and GLM-5.3-Flash's ``glm5_next``: KPool pools, index sharing
across draft steps; ``--preset``), single and batched calls, on bf16 (or float16/32/64) weights;
the fp8 weights' agreement is tested beside the kernels (``tests/optimized/test_fp8.py``).

The package, one concept per module: ``ops`` (scenario arguments and ops as data), ``spec`` (the
spec model that stamps each op with its outcome), ``scenarios`` (a run's scenarios, saved and
loaded), ``choices`` (a ``Chooser`` and the argument helpers), ``single_state`` and ``batched``
(the generators), ``backends`` (names to proposers), ``side`` (one backend's half of a lockstep),
``lockstep`` (both halves compared after every call), ``report`` (findings and the run's table),
``runner`` (run and record), ``mutants/`` (drafters that each break one rule, the registry in its
``__init__``), ``compare``, ``sharded``, ``grammars`` (grammars as data and their matcher),
``machines/`` (the hypothesis state machines: ``machine``, ops as data; ``arguments`` and
``hostile_values``, hostile arguments).
"""

from .backends import BackendError, resolve_backend
from .compare import EXPORT_KEYS, first_mismatch, snapshots_equal
from .lockstep import Harness, Lockstep, run_scenario
from .mutants import MUTANTS
from .mutants.base import Mutant
from .report import Difference, Finding, Report
from .runner import record, run
from .scenarios import GENERATORS, MAX_DRAFTS, Scenario, load_scenario, save_scenario, scenario
from .ops import Hidden, Op, TokenIds
from .spec import SpecModel

__all__ = [
    "run", "record", "Report", "Difference", "Finding", "BackendError", "resolve_backend", "Harness", "Lockstep",
    "run_scenario",
    "scenario", "save_scenario", "load_scenario", "Scenario", "Op", "SpecModel", "Hidden", "TokenIds", "GENERATORS",
    "MAX_DRAFTS",
    "MUTANTS", "Mutant", "EXPORT_KEYS", "first_mismatch", "snapshots_equal",
]
