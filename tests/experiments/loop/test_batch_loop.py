"""The batched speculative loop (``SpeculativeDecoder.generate_batch``): every prompt's
tokens and counters equal the single-sequence ``generate`` on it alone, for both drafter
backends; one ``propose_batch`` per round for every live sequence and one ``catchup_batch`` for
the fully accepted ones; finished sequences leave the batch and free their state; and the
acceptance entry point's ``batch_size`` leaves the summary's numbers as they are."""

import json
import random

import pytest
import torch
from hydra import compose, initialize_config_module

from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
from glm_mtp.experiments.settings import validate
from glm_mtp.experiments.targets.checkpoint import load_checkpoint
from glm_mtp.experiments.loop.speculative import SpeculativeDecoder, make_proposer, target_decode
from glm_mtp.experiments.targets.target import Target
from glm_mtp.registry import backend_class
from glm_mtp.experiments.reporting.summary_keys import lossless_greedy

BACKENDS = ("reference", "optimized")
LENGTHS = (5, 1, 9, 12)  # prompt lengths: different, a one-token prompt among them


def prompts_of(vocab, lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def counters(stats):
    """Every ``SpecStats`` field but the seconds."""
    return (stats.num_drafts, stats.reached, stats.accepted, stats.steps, stats.committed)


def oracle_class(backend):
    """The backend's drafter (its state machine and rows as they are) with the drafts it returns
    taken from each sequence's known greedy continuation, each wrong with probability ``p_wrong``
    (a random generator per sequence): the loop sees every accept count, ``a == k`` included.
    Sequences are matched to states in allocation order (the order both loops allocate in)."""

    class Oracle(backend_class(backend)):
        def __init__(self, weights, max_seq_len, continuations, p_wrong):
            super().__init__(weights, max_seq_len)
            self.queue, self.p_wrong, self.of = list(continuations), p_wrong, {}
            self.batch_sizes, self.allocated = [], 0

        def alloc_state(self, device):
            st = super().alloc_state(device)
            self.allocated += 1
            self.of[id(st)] = (self.queue.pop(0), random.Random(self.allocated))
            return st

        def _drafts(self, position, k, state):
            seq, rng = self.of[id(state)]
            out = []
            for i in range(k):
                tok = seq[position + 2 + i]  # draft i+1 guesses t_{m+1+i}, m = position + 1
                out.append((tok + 1) % self.config.vocab_size if rng.random() < self.p_wrong else tok)
            return out

        def propose(self, last_token, target_hidden, position, num_drafts, state):
            super().propose(last_token, target_hidden, position, num_drafts, state)
            return self._drafts(position, num_drafts, state)

        def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states):
            super().propose_batch(last_tokens, target_hiddens, positions, num_drafts, states)
            self.batch_sizes.append(len(states))
            return [self._drafts(p, num_drafts, st) for p, st in zip(positions, states)]

    return Oracle


@pytest.fixture(scope="module")
def shipped32():
    return load_checkpoint(None, torch.float32)


def check_batch_equals_single(make_prop, target, prompts, k, new):
    one = SpeculativeDecoder(target, make_prop(), k)  # prompt after prompt, one drafter
    single = [one.generate(p, new) for p in prompts]
    prop = make_prop()
    batch = SpeculativeDecoder(target, prop, k).generate_batch(prompts, new)
    assert len(batch) == len(prompts)
    for b, (s, r) in enumerate(zip(single, batch)):
        assert r.tokens == s.tokens, b
        assert r.committed == s.committed, b
        assert counters(r.stats) == counters(s.stats), b
    return single, batch, prop


@pytest.mark.parametrize("backend", BACKENDS)
def test_oracle_drafts_batch_equals_single_at_tiny(tiny64, target64, backend):
    # Oracle drafts at tiny: a mix of every accept count, the catch-ups of a == k included.
    k, new = 3, 16
    prompts = prompts_of(tiny64.target.config.vocab_size)
    conts = [p + target_decode(target64, p, new + k + 8) for p in prompts]
    make = lambda: oracle_class(backend)(tiny64.mtp, 128, conts, p_wrong=0.25)  # noqa: E731
    single, batch, prop = check_batch_equals_single(make, target64, prompts, k, new)
    for r, p in zip(batch, prompts):
        assert r.tokens == target_decode(target64, p, new)  # greedy: lossless
    assert sum(r.stats.accepted[k - 1] for r in batch) > 0  # full acceptances: catch-ups ran
    assert sum(r.stats.steps - r.stats.accepted[0] for r in batch) > 0  # and rejections
    assert len(prop.batch_sizes) == max(r.stats.steps for r in batch)  # one propose_batch per round
    assert prop.batch_sizes[0] == len(prompts) and prop.batch_sizes == sorted(prop.batch_sizes, reverse=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_drafter_batch_equals_single_at_tiny(tiny64, target64, backend):
    # The drafter's own drafts (a random tiny model: mostly rejected).
    check_batch_equals_single(lambda: make_proposer(backend, tiny64.mtp, 128), target64,
                              prompts_of(tiny64.target.config.vocab_size, seed=1), 3, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_drafter_batch_equals_single_on_the_shipped_model(shipped32, backend):
    # The trained drafter's own drafts, float32: often all accepted, so catchup_batch serves
    # several sequences in one call.
    k = 3
    target = Target(shipped32.target, 128)
    single, batch, _ = check_batch_equals_single(lambda: make_proposer(backend, shipped32.mtp, 128), target,
                                                 prompts_of(shipped32.target.config.vocab_size, seed=2), k, 20)
    assert sum(r.stats.accepted[k - 1] > 0 for r in batch) >= 3, [r.stats.accepted for r in batch]
    assert sum(r.stats.steps - r.stats.accepted[k - 1] for r in batch) > 0


def test_a_batch_past_max_batch_goes_in_parts(shipped32):
    # The optimized drafter takes at most max_batch states per call: 4 sequences, max_batch 3.
    k = 3
    target = Target(shipped32.target, 128)
    make = lambda: Spy(backend_class("optimized")(shipped32.mtp, 128, max_batch=3))  # noqa: E731
    single, batch, spy = check_batch_equals_single(make, target, prompts_of(shipped32.target.config.vocab_size, seed=2),
                                                   k, 20)
    sizes = [len(sts) for ev, sts in spy.events if ev in ("propose_batch", "catchup_batch")]
    assert max(sizes) == 3 and 1 in sizes


class Spy:
    """Wraps a drafter and logs the calls that allocate, batch and free states."""

    def __init__(self, inner, fail_at_round=None):
        self.inner, self.events, self.fail_at_round, self.rounds = inner, [], fail_at_round, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def alloc_state(self, device):
        st = self.inner.alloc_state(device)
        self.events.append(("alloc", st))
        return st

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states):
        self.rounds += 1
        if self.rounds == self.fail_at_round:
            raise KeyboardInterrupt("interrupted")
        self.events.append(("propose_batch", list(states)))
        return self.inner.propose_batch(last_tokens, target_hiddens, positions, num_drafts, states)

    def catchup_batch(self, tokens, hiddens, row_bases, states):
        self.events.append(("catchup_batch", list(states)))
        return self.inner.catchup_batch(tokens, hiddens, row_bases, states)

    def free_state(self, state):
        self.events.append(("free", state))
        return self.inner.free_state(state)


def test_leaving_sequences_free_their_states(shipped32):
    k, wants = 3, [14, 1, 5, 22]  # per prompt: they leave at different rounds (one before any round)
    target = Target(shipped32.target, 128)
    prompts = prompts_of(shipped32.target.config.vocab_size, seed=2)
    spy = Spy(make_proposer("reference", shipped32.mtp, 128))
    batch = SpeculativeDecoder(target, spy, k).generate_batch(prompts, wants)
    ref = make_proposer("reference", shipped32.mtp, 128)
    for p, n, r in zip(prompts, wants, batch):  # a per-prompt max_new_tokens, as generate's
        s = SpeculativeDecoder(target, ref, k).generate(p, n)
        assert r.tokens == s.tokens and len(r.tokens) == n and counters(r.stats) == counters(s.stats)

    states = [st for ev, st in spy.events if ev == "alloc"]
    assert len(states) == len(prompts)
    freed = [st for ev, st in spy.events if ev == "free"]
    assert len(freed) == len(states) and {id(s) for s in freed} == {id(s) for s in states}  # each once
    assert all(st.released for st in states)
    rounds = [sts for ev, sts in spy.events if ev == "propose_batch"]
    assert spy.events[-1][0] == "free" and len(rounds) == max(r.stats.steps for r in batch)
    for b, st in enumerate(states):
        at = next(i for i, (ev, s) in enumerate(spy.events) if ev == "free" and s is st)
        # never in a batched call after it left; in exactly its steps' rounds before
        assert not any(
            ev != "free" and any(s is st for s in sts) for ev, sts in spy.events[at + 1 :] if ev != "alloc"
        ), b
        assert sum(any(s is st for s in sts) for sts in rounds) == batch[b].stats.steps, b
        # it left as soon as it had its tokens: the round after its last step has not begun
        later = [ev for ev, _ in spy.events[at + 1 :] if ev == "propose_batch"]
        assert len(later) == len(rounds) - batch[b].stats.steps, b
    assert [len(sts) for sts in rounds] == sorted((len(sts) for sts in rounds), reverse=True) and len(rounds[0]) == 3
    catchups = [sts for ev, sts in spy.events if ev == "catchup_batch"]
    assert sum(len(sts) for sts in catchups) == sum(r.stats.accepted[k - 1] for r in batch) > 0
    assert any(len(sts) > 1 for sts in catchups)  # one call served several sequences


def test_a_failure_midway_frees_every_state(shipped32):
    target = Target(shipped32.target, 128)
    spy = Spy(make_proposer("reference", shipped32.mtp, 128), fail_at_round=3)
    with pytest.raises(KeyboardInterrupt):
        SpeculativeDecoder(target, spy, 3).generate_batch(prompts_of(shipped32.target.config.vocab_size, seed=2), 30)
    states = [st for ev, st in spy.events if ev == "alloc"]
    assert len(states) == 4 and all(st.released for st in states)
    assert len([1 for ev, _ in spy.events if ev == "free"]) == 4


def test_one_prompt_at_temperature_one_is_generate(shipped32):
    # One prompt draws from the loop's generator in generate's order: the same samples.
    target = Target(shipped32.target, 128)
    p = prompts_of(shipped32.target.config.vocab_size, (7,), seed=3)[0]
    s = SpeculativeDecoder(target, make_proposer("reference", shipped32.mtp, 128), 3, temperature=1.0,
                           seed=5).generate(p, 20)
    (r,) = SpeculativeDecoder(
        target, make_proposer("reference", shipped32.mtp, 128), 3, temperature=1.0, seed=5
    ).generate_batch([p], 20)
    assert r.tokens == s.tokens and counters(r.stats) == counters(s.stats)


def test_single_sequence_options_are_refused(tiny64, target64):
    prop = make_proposer("reference", tiny64.mtp, 128)
    with pytest.raises(ValueError, match="policy='refeed'"):
        SpeculativeDecoder(target64, prop, 2, "refeed").generate_batch([[1, 2]], 4)
    with pytest.raises(ValueError, match="draft='sampled'"):
        SpeculativeDecoder(target64, prop, 2, temperature=1.0, draft="sampled").generate_batch([[1, 2]], 4)
    dec = SpeculativeDecoder(target64, prop, 2)
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        dec.generate_batch([[1, 2], [3]], [4])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        dec.generate_batch([[1, 2], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        dec.generate_batch([[1, 2]], 0)


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


TIMINGS = ("wall_seconds", "draft_seconds", "verify_seconds", "prefill_seconds", "draft_share", "batch_size")


def test_entry_point_batch_size_keeps_the_summary(tmp_path):
    # Five held-out prompts of the shipped GLM-5 model: batches of 4 and 1 against one at a time.
    common = ["model=shipped", "logger=none", "experiment=smoke", "run.num_prompts=5", "run.max_new_tokens=12",
              "speedup.costs=glm5"]
    one = run_acceptance(config(common), str(tmp_path / "b1"))
    four = run_acceptance(config(common + ["batch_size=4"]), str(tmp_path / "b4"))
    assert one["batch_size"] == 1 and four["batch_size"] == 4
    assert one["counts"]["accepted"][-1] > 0 and lossless_greedy(one) is True
    keep = lambda s: json.dumps({k: v for k, v in s.items() if k not in TIMINGS}, sort_keys=True)  # noqa: E731
    assert keep(one) == keep(four)
    on_disk = json.loads((tmp_path / "b4" / "summary.json").read_text())
    assert keep(on_disk) == keep(json.loads((tmp_path / "b1" / "summary.json").read_text()))


@pytest.mark.parametrize("overrides, match", [
    (["batch_size=0"], "^batch_size must be an integer >= 1"),
    (["batch_size=2.5"], "^batch_size must be an integer >= 1"),
    (["batch_size=2", "mode=teacher_forced"], "^batch_size > 1 .* mode=teacher_forced"),
    (["batch_size=2", "policy=refeed"], "^batch_size > 1 .* policy=refeed"),
    (["batch_size=2", "temperature=1", "draft=sampled"], "^batch_size > 1 .* draft=sampled"),
])
def test_bad_batch_sizes_are_refused_before_work(overrides, match):
    # validation refuses them (the entry point runs it before run(), which re-checks nothing)
    with pytest.raises(ValueError, match=match):
        validate.check_acceptance(config(overrides))


def test_batch_size_defaults_to_one_and_composes():
    assert config([]).batch_size == 1
    validate.check_acceptance(config(["batch_size=4"]))
    validate.check_acceptance(config(["batch_size=4", "temperature=1"]))
