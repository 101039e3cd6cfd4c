"""Scenarios: reproducible sequences of drafter calls, each with the outcome the spec predicts.

A scenario is plain data: a list of ``Op`` (see ``spec.py``: the arguments as data, and
``SpecModel``, which stamps every op with the outcome DESIGN.md §4 predicts).

The generators, each driven by a ``Chooser`` (``choices.py``: where randomness comes from), live
by family in ``single_state.py`` and ``batched.py``:

- ``realistic``: the spec-decode loop of DESIGN.md §4 on one to three states: prefill, then
  propose -> verify (random acceptance) -> catch-up, with the refeed policy, engine rollbacks,
  capacity edges and double frees mixed in.
- ``adversarial``: a walk over the rules in ``RULES`` (misuse, odd orders, bad inputs, capacity
  edges). ``machines/machine.py`` drives the same rules from hypothesis (a ``RuleBasedStateMachine``).
- ``batched`` (not a default; ``--generators batched``): 2-6 states joining and leaving at very
  different lengths, drafted together by ``propose_batch`` and caught up by ``catchup_batch``,
  with single calls interleaved and batched misuse.

Every scenario also draws whether the drafters share step 1's selection across a propose
(``index_share``, DESIGN.md §9): both sides draft with their weights' config replaced
(``MtpWeights.with_index_share``), so either family runs both ways whatever its checkpoint says.
When both backends take grammars (``grammars``), every generator also draws, per propose, a
grammar (``grammars.Grammar``, §10) and a sampling (``propose_sampled``), and the lockstep compares
each pending propose's confidences (§12).

``scenario(seed, index, ...)`` builds scenario ``index`` of a run seeded ``seed``; it depends on
nothing else, so ``--seed S --scenario-index I`` replays it exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

from glm_mtp.reference.config import MtpConfig

from .batched import batched
from .choices import MAX_DRAFTS, RandomChooser
from .single_state import adversarial, realistic
from .ops import Op
from .spec import SpecModel

# The generators a run uses unless told otherwise, and every generator a run may name.
GENERATORS = ("realistic", "adversarial")
ALL_GENERATORS = GENERATORS + ("batched",)
# The least max_seq_len the generators serve: their prompts hold 2 or more tokens (one row or more).
MIN_MAX_SEQ_LEN = 2


@dataclass(frozen=True)
class Scenario:
    """Scenario ``index`` of a run seeded ``seed``: its generator, its own seed, and its ops."""

    seed: int
    index: int
    generator: str
    scenario_seed: int
    ops: tuple[Op, ...]
    index_share: bool | None = None  # §9 on or off for both sides; None: as the weights' config says


def save_scenario(path: str, ops: Sequence[Op], origin: str = "", index_share: bool | None = None) -> None:
    """Write ops (and the scenario's index sharing, §9) to a JSON file that ``load_scenario`` (and
    ``--scenario-file``) reads back."""
    with open(path, "w") as f:
        json.dump({"origin": origin, "index_share": index_share, "ops": [op.to_dict() for op in ops]}, f, indent=1)


def load_scenario(path: str) -> Scenario:
    """A scenario saved by ``save_scenario`` (e.g. by the hypothesis machine on a failure);
    ``ValueError`` naming the file if it holds anything else (``OSError`` if it cannot be read)."""
    with open(path) as f:
        try:
            raw = json.load(f)
            ops = tuple(Op.from_dict(d) for d in raw["ops"])
            index_share = raw.get("index_share")
            if index_share is not None and not isinstance(index_share, bool):
                raise ValueError(f"index_share must be true, false or null, got {index_share!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"scenario file {path}: not a scenario saved by save_scenario "
                             f"({type(e).__name__}: {e})") from e
    return Scenario(seed=-1, index=0, generator="file", scenario_seed=-1, ops=ops, index_share=index_share)


def max_drafts_limit(config: MtpConfig, max_seq_len: int) -> int:
    """The largest ``max_drafts`` the generators serve: the rows a state has left after a prompt
    of ``max_seq_len`` tokens (the capacity-edge rules draft from there)."""
    m = SpecModel(config, max_seq_len)
    return m.capacity - (m.max_seq_len - 1)


def draws_index_share(seed: int, index: int) -> bool:
    """Whether scenario ``index`` of run ``seed`` drafts with index sharing (§9): a fair draw of
    its own, so the ops a generator chooses do not depend on it."""
    return bool(hashlib.blake2b(f"glm-mtp-conformance:index_share:{seed}:{index}".encode(),
                                digest_size=1).digest()[0] & 1)


def scenario_seed(seed: int, index: int) -> int:
    """A 63-bit seed for scenario ``index`` of run ``seed`` (stable across Python versions)."""
    digest = hashlib.blake2b(f"glm-mtp-conformance:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def scenario(
    seed: int, index: int, config: MtpConfig, max_seq_len: int,
    generators: Sequence[str] = GENERATORS, max_drafts: int = MAX_DRAFTS, grammars: bool = False,
) -> Scenario:
    """Build scenario ``index`` of a run seeded ``seed``; generators take turns by index.

    Args:
        seed: the run's seed.
        index: which scenario (0-based).
        config: the drafter's config.
        max_seq_len: the proposers' ``max_seq_len``.
        generators: names from ``GENERATORS``; scenario ``index`` uses ``generators[index % len]``.
        max_drafts: the largest ``num_drafts`` a valid propose uses.
        grammars: draw grammars (DESIGN.md §10) and sampled proposes for the proposes (both
            backends must take them: ``lockstep.Harness.grammars``).
    """
    for g in generators:
        if g not in ALL_GENERATORS:
            raise ValueError(f"generators: unknown generator {g!r}; known: {ALL_GENERATORS}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < MIN_MAX_SEQ_LEN:
        raise ValueError(f"max_seq_len must be an integer >= {MIN_MAX_SEQ_LEN} (the generators' prompts hold 2 or more "
                         f"tokens), got {max_seq_len!r}")
    limit = max_drafts_limit(config, max_seq_len)
    if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or not 1 <= max_drafts <= limit:
        raise ValueError(f"max_drafts must be an integer in [1, {limit}] (the rows left after a prompt of "
                         f"max_seq_len={max_seq_len} tokens), got {max_drafts!r}")
    gen = generators[index % len(generators)]
    s = scenario_seed(seed, index)
    share = draws_index_share(seed, index)
    model = SpecModel(config, max_seq_len, share, grammars)
    ops = {"realistic": realistic, "adversarial": adversarial, "batched": batched}[gen](RandomChooser(s), model,
                                                                                        max_drafts)
    return Scenario(seed, index, gen, s, tuple(ops), share)
