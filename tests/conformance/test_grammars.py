"""Grammars and confidences in the conformance suite (DESIGN.md §10, §12): the scenarios draw
grammars and sampled proposes when both backends take them, the spec model predicts what a
propose under a grammar returns, the lockstep compares confidences and checks every matcher is
left as found, and a backend that cannot take grammars runs with them off, visibly."""

import random

import pytest
import torch

from glm_mtp.conformance import run, scenario
from glm_mtp.conformance.backends import BackendError
from glm_mtp.conformance.grammars import ENDS, Grammar
from glm_mtp.conformance.ops import Op, Sampling
from glm_mtp.conformance.scenarios import load_scenario, save_scenario
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.contract import takes_grammars


SINGLE, BATCHED = ("realistic", "adversarial"), ("batched",)


@pytest.mark.parametrize("preset, generators, scenarios", [
    ("tiny", SINGLE, 4),
    pytest.param("glm5next_tiny", SINGLE, 4, marks=pytest.mark.slow),
    pytest.param("tiny", BATCHED, 4, marks=pytest.mark.slow),
    pytest.param("glm5next_tiny", BATCHED, 4, marks=pytest.mark.slow),
])
def test_the_reference_equals_itself_with_grammars_sampling_and_confidences(preset, generators, scenarios):
    """Both families (the mutants' runs cover glm5next_tiny and batches by default too); the
    scenarios draw sharing on and off (run 0..3 of seed 3 holds both)."""
    r = run("reference", "reference", scenarios=scenarios, seed=3, preset=preset, generators=generators)
    assert r.ok, r.first_difference
    assert r.grammars and "grammars=on" in r.summary()
    cfg = MtpConfig.preset(preset)
    shares = {scenario(3, i, cfg, 64, generators, grammars=True).index_share for i in range(scenarios)}
    assert shares == {True, False}


def test_the_scenarios_draw_every_kind_of_grammar():
    """Over a run's scenarios: bounded and unbounded automata, both ends, starts past the root,
    lying and broken matchers, sampled proposes, batches with grammars, and refusals predicted."""
    cfg = MtpConfig.preset("tiny")
    ops = [op for i in range(60) for op in scenario(0, i, cfg, 64, ("realistic", "adversarial", "batched"),
                                                     grammars=True).ops]
    grammars = [op.args["grammar"] for op in ops if "grammar" in op.args]
    batch_grammars = [g for op in ops for g in op.args.get("grammars") or () if g is not None]
    assert {g.depth is None for g in grammars} == {True, False} and {g.end for g in grammars} == set(ENDS)
    assert any(g.start > 0 for g in grammars) and any(g.liar is not None for g in grammars)
    assert any(g.fault for g in grammars) and batch_grammars
    assert any("sampling" in op.args for op in ops)
    assert any(op.expect == "ValueError" and "refuses draft step" in op.note for op in ops)
    assert any(op.kind == "propose" and op.expect == "ok" and op.returns < op.args["num_drafts"] for op in ops)
    # without grammars the same run draws none: its scenarios are those of a backend without them
    plain = [op for i in range(30) for op in scenario(0, i, cfg, 64, ("realistic", "adversarial", "batched")).ops]
    assert not any({"grammar", "grammars", "sampling"} & set(op.args) for op in plain)


def test_the_spec_predicts_what_a_propose_under_a_grammar_returns():
    """``Grammar.drafts`` and ``Grammar.refuses`` (what the spec model stamps) against the
    reference, over random automata and draft counts."""
    cfg = MtpConfig.preset("tiny")
    prop = ReferenceProposer(MtpWeights.random(cfg, seed=0, dtype=torch.bfloat16), 64)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(torch.randint(cfg.vocab_size, (20,), generator=gen),
                         torch.randn(20, cfg.hidden_size, generator=gen).bfloat16(), state)
    refused = stopped = 0
    for _ in range(60):
        depth = rng.choice([None, rng.randint(0, 5)])
        g = Grammar(rng.randrange(2**31), depth, rng.randint(0, depth or 3), rng.choice(ENDS),
                    rng.choice([None, None, rng.randint(0, 3)]))
        k = rng.randint(0, 4)
        hidden = torch.randn(cfg.hidden_size, generator=gen).bfloat16()
        if g.refuses(k):
            with pytest.raises(ValueError, match="refused draft step"):
                prop.propose(rng.randrange(cfg.vocab_size), hidden, 19, k, state, grammar=g.matcher(cfg.vocab_size))
            refused += 1
            continue
        drafts = prop.propose(rng.randrange(cfg.vocab_size), hidden, 19, k, state, grammar=g.matcher(cfg.vocab_size))
        assert len(drafts) == g.drafts(k)
        stopped += len(drafts) < k
        prop.after_verify(0, state)
    assert refused and stopped


def test_a_scenario_with_grammars_saves_and_loads_back_the_same(tmp_path):
    op = Op("propose", 0, {"num_drafts": 3, "grammar": Grammar(5, 2, 1, "empty", 1, None),
                           "sampling": Sampling(7, 1.7)}, "ok", returns=1)
    batch = Op("propose_batch", -1, {"states": (0, 1), "grammars": (None, Grammar(2))}, "ok", returns=[3, 3])
    path = str(tmp_path / "s.json")
    save_scenario(path, [op, batch], index_share=True)
    assert load_scenario(path).ops == (op, batch)


class WithoutConfidence:
    """A drafter that drafts as the reference but has no ``draft_confidence`` (nor grammars)."""

    def __init__(self, weights, max_seq_len):
        self._inner = ReferenceProposer(weights, max_seq_len)

    def __getattr__(self, name):
        if name == "draft_confidence":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_backend_without_grammars_runs_with_them_off_and_says_so():
    r = run(WithoutConfidence, "reference", scenarios=1, seed=0)
    assert r.ok and not r.grammars and "grammars=off" in r.summary()
    assert "--grammars off" in run("mutant:trim_first_row", "reference", scenarios=3, seed=0,
                                   grammars=False).first_difference.replay
    with pytest.raises(BackendError, match="does not take grammars"):
        run(WithoutConfidence, "reference", scenarios=1, grammars=True)


def test_the_optimized_backend_runs_with_grammars_exactly_when_it_takes_them():
    """Until the optimized drafter takes grammars, its runs have them off (named in the
    report); once it does, they are on and compared like everything else."""
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.bfloat16)
    r = run("optimized", "reference", scenarios=1, seed=0)
    assert r.ok, r.first_difference
    assert r.grammars == takes_grammars(OptimizedProposer(w, 64))
