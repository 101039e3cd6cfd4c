"""The generators: reproducible from (seed, index), and covering every case DESIGN.md §4 names."""

from collections import Counter

import torch

from glm_mtp.conformance.scenarios import MAX_DRAFTS, load_scenario, save_scenario, scenario
from glm_mtp.conformance.ops import Hidden, TokenIds
from glm_mtp.conformance.spec import SpecModel
from glm_mtp.reference import MtpConfig

CFG = MtpConfig.preset("tiny")
MAX_SEQ_LEN = 64


def test_same_seed_and_index_same_scenario():
    a = scenario(3, 17, CFG, MAX_SEQ_LEN)
    b = scenario(3, 17, CFG, MAX_SEQ_LEN)
    assert a == b and [o.to_dict() for o in a.ops] == [o.to_dict() for o in b.ops]
    assert scenario(3, 18, CFG, MAX_SEQ_LEN).ops != a.ops
    assert scenario(4, 17, CFG, MAX_SEQ_LEN).ops != a.ops
    assert {scenario(0, i, CFG, MAX_SEQ_LEN).generator for i in range(4)} == {"realistic", "adversarial"}


def test_a_saved_scenario_loads_back_the_same(tmp_path):
    for i in range(2):
        ops = scenario(0, i, CFG, MAX_SEQ_LEN).ops
        save_scenario(str(tmp_path / "s.json"), ops)
        assert load_scenario(str(tmp_path / "s.json")).ops == ops


def test_hidden_rows_are_fresh_random_and_never_zero():
    h = Hidden(seed=5, rows=3)
    t = h.materialize(CFG.hidden_size, torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, CFG.hidden_size) and t.dtype == torch.bfloat16
    assert bool((t != 0).any(dim=1).all())
    assert torch.equal(t.view(torch.int16),
                       h.materialize(CFG.hidden_size, torch.bfloat16, torch.device("cpu")).view(torch.int16))
    assert not torch.equal(t, Hidden(seed=6, rows=3).materialize(CFG.hidden_size, torch.bfloat16, torch.device("cpu")))
    nan = Hidden(seed=5, rows=3, fault="nan").materialize(CFG.hidden_size, torch.float32, torch.device("cpu"))
    assert int(nan.isnan().sum()) == 1
    assert (
        Hidden(seed=5, rows=1, fault="device")
        .materialize(CFG.hidden_size, torch.float32, torch.device("cpu"))
        .device.type
        == "meta"
    )
    assert Hidden(seed=5, rows=1, flat=True).materialize(CFG.hidden_size, torch.float32, torch.device("cpu")).shape == (
        CFG.hidden_size,
    )


def test_token_refs_resolve_to_drafts():
    t = TokenIds((5, "d2", "d1"), "int32")
    out = t.materialize([40, 41], torch.device("cpu"))
    assert out.dtype == torch.int32 and out.tolist() == [5, 41, 40]


def _coverage(n_scenarios: int) -> Counter:
    """Tags for every case of DESIGN.md §4 that the generated ops exercise (spec outcomes)."""
    cap_rows = SpecModel(CFG, MAX_SEQ_LEN).capacity
    seen: Counter = Counter()
    for i in range(n_scenarios):
        sc = scenario(0, i, CFG, MAX_SEQ_LEN)
        seen[sc.generator] += 1
        rows: dict[int, int] = {}
        freed: set[int] = set()
        for op in sc.ops:
            before = rows.get(op.state, 0)
            a, e = op.args, op.expect
            if op.kind == "prefill":
                n = len(a["prompt_tokens"])
                size = {0: "0", 1: "1", MAX_SEQ_LEN: "cap", MAX_SEQ_LEN + 1: "over cap"}.get(n, "typical")
                seen[f"prefill {size} {e}"] += 1
            elif op.kind == "catchup":
                if e == "ok":
                    seen["catchup aligned"] += 1
                    if a["pos_base"] != a["row_base"]:
                        seen["catchup pos_base != row_base"] += 1
                    if a["row_base"] + len(a["tokens"]) == cap_rows:
                        seen["catchup to the last row"] += 1
                if e == "noop" and a["row_base"] != before:
                    seen["catchup misaligned"] += 1
            elif op.kind == "propose" and isinstance(a["position"], int) and not isinstance(a["position"], bool):
                if e == "ok":
                    seen[f"propose k={a['num_drafts']}"] += 1
                    seen["propose " + ("equal" if a["position"] == before else "ahead")] += 1
                    if a["position"] + a["num_drafts"] == cap_rows:
                        seen["propose to the last row"] += 1
                if e == "RuntimeError" and op.state not in freed and a["position"] > before:
                    seen["propose behind"] += 1
                if (
                    e == "ValueError"
                    and isinstance(a["num_drafts"], int)
                    and a["position"] + a["num_drafts"] == cap_rows + 1
                ):
                    seen["propose past capacity"] += 1
            elif op.kind == "verify":
                if e == "ok":
                    seen[f"verify a={a['num_accepted']}"] += 1
                else:
                    seen[f"verify {e}"] += 1
            elif op.kind == "free":
                seen[f"free {e}"] += 1
                freed.add(op.state)
            if op.kind in ("prefill", "catchup", "propose", "verify") and op.state in freed and e == "RuntimeError":
                seen["use after free"] += 1
            for v in a.values():
                if isinstance(v, Hidden) and v.fault and e == "ValueError":
                    seen[f"hidden {v.fault}"] += 1
                if (
                    isinstance(v, TokenIds)
                    and e == "ValueError"
                    and any(isinstance(t, int) and not 0 <= t < CFG.vocab_size for t in v.ids)
                ):
                    seen["token out of range"] += 1
            if op.kind == "alloc":
                seen[f"alloc {e}"] += 1
            if op.rows_after is not None and op.state >= 0:
                rows[op.state] = op.rows_after
    return seen


def test_generators_cover_every_scenario_case():
    seen = _coverage(200)
    want = (
        ["prefill 0 noop", "prefill 1 noop", "prefill typical ok", "prefill cap ok", "prefill over cap ValueError"]
        + ["catchup aligned", "catchup misaligned", "catchup pos_base != row_base", "catchup to the last row"]
        + [f"propose k={k}" for k in range(MAX_DRAFTS + 1)]
        + ["propose equal", "propose ahead", "propose behind", "propose to the last row", "propose past capacity"]
        + [f"verify a={a}" for a in range(MAX_DRAFTS + 1)] + ["verify RuntimeError", "verify ValueError"]
        + ["free ok", "free noop", "use after free", "alloc ok", "alloc ValueError", "token out of range"]
        + [f"hidden {f}" for f in Hidden.FAULTS]
    )
    missing = [w for w in want if seen[w] == 0]
    assert not missing, f"never generated: {missing}"
