"""The round's own pieces: its rules' checks, verification by name, the truncation helper, and
the deferred catch-up's refusal."""

import pytest
import torch

from glm_mtp.experiments.loop.round import RoundRules, play_round, truncate_drafter
from glm_mtp.experiments.loop.verify import greedy_verify, stochastic_verify, verify
from glm_mtp.reference import ReferenceProposer
from glm_mtp.reference.bytes import same_bytes


def test_truncate_drafter_leaves_the_rows_before_and_nothing_pending(tiny64, target64, random_prompt):
    prompt = random_prompt(96, 10, 1)
    prop = ReferenceProposer(tiny64.mtp, 128)
    out = target64.prefill(prompt, target64.alloc_state())
    fresh, state = prop.alloc_state("cpu"), prop.alloc_state("cpu")
    prop.prefill_drafter(prompt, out.hidden, fresh)  # rows [0, 9)
    prop.prefill_drafter(prompt, out.hidden, state)
    prop.propose(prompt[-1], out.hidden[-1:], 9, 3, state)
    prop.after_verify(2, state)  # rows [0, 12)
    truncate_drafter(prop, state, 9, prompt[-1], out.hidden[-1:])
    assert prop.drafter_rows(state) == 9
    a, b = prop.export_state(state), prop.export_state(fresh)
    assert all(same_bytes(a[key], b[key]) for key in ("kv_rows", "index_rows", "seq_len", "pending", "last_drafted"))
    assert prop.propose(prompt[-1], out.hidden[-1:], 9, 2, state) == prop.propose(prompt[-1], out.hidden[-1:], 9, 2,
                                                                                     fresh)


def test_verify_chooses_the_rule_by_name():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    drafts = torch.argmax(logits[:3], -1).tolist()
    drafts[2] = (drafts[2] + 1) % 11
    ours = verify("greedy", logits, drafts, 0.0, torch.Generator())
    assert ours == greedy_verify(logits, drafts) == (2, int(logits[2].argmax()))
    ours = verify("rejection", logits, drafts, 1.0, torch.Generator().manual_seed(5))
    assert ours == stochastic_verify(logits, drafts, 1.0, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="verify rule must be one of"):
        verify("exact", logits, drafts, 1.0, torch.Generator())


@pytest.mark.parametrize("kw, message", [
    ({"verify": "greedy", "temperature": 1.0}, "verify=greedy is the temperature-0 rule"),
    ({"verify": "rejection", "temperature": 0.0}, "verify=rejection samples at the temperature"),
    ({"verify": "exact"}, "verify must be one of"),
    ({"num_drafts": 0}, "num_drafts must be an integer >= 1"),
    ({"policy": "keep_all"}, "policy must be one of"),
])
def test_round_rules_refuse_what_does_not_fit(kw, message):
    args = {"num_drafts": 2, "verify": "greedy", "gen": torch.Generator(), **kw}
    with pytest.raises(ValueError, match=message):
        RoundRules(**args)


def test_a_deferred_catchup_is_first_row_kept_only(tiny64, target64):
    rules = RoundRules(2, "greedy", torch.Generator(), policy="refeed")
    prop = ReferenceProposer(tiny64.mtp, 128)
    with pytest.raises(ValueError, match="deferred catch-up"):
        play_round(rules, target64, prop, None, None, 1, torch.zeros(1, 1), 5, drafts=[1, 2], defer_catchup=True)
