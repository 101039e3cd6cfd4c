"""The conformance suite: does a drafter backend equal the reference bit for bit?

    from glm_mtp.conformance import run
    report = run("optimized", "reference", scenarios=200, seed=0, device="cpu")
    assert report.ok, report.first_difference

or ``python -m glm_mtp.conformance --candidate optimized --baseline reference``. Only torch (and
the reference) is needed to import it; hypothesis only for ``machine.py``
(``from glm_mtp.conformance.machine import lockstep_machine``); no Hydra, no W&B.
"""

from .compare import EXPORT_KEYS, first_mismatch, snapshots_equal
from .mutants import MUTANTS, Mutant
from .runner import BackendError, Difference, Finding, Harness, Lockstep, Report, record, resolve_backend, run, run_scenario
from .scenarios import GENERATORS, MAX_DRAFTS, Hidden, Model, Op, Scenario, Tokens, load_scenario, save_scenario, scenario

__all__ = [
    "run", "record", "Report", "Difference", "Finding", "BackendError", "resolve_backend", "Harness", "Lockstep", "run_scenario",
    "scenario", "save_scenario", "load_scenario", "Scenario", "Op", "Model", "Hidden", "Tokens", "GENERATORS", "MAX_DRAFTS",
    "MUTANTS", "Mutant", "EXPORT_KEYS", "first_mismatch", "snapshots_equal",
]
