"""docs/performance.md's launch and byte tables come from the counters' records: every cell reads
the record of its own preset, dtype, weights, sharing, backend and capacity (fake records here;
``tests/tools/test_counters.py`` proves the counts themselves)."""

import pytest

from glm_mtp.tools import step_tables


def fake_count(key):
    """A record whose numbers encode its key, so a cell read from the wrong record shows."""
    preset, dtype, weights, share, backend, max_seq_len = key
    base = 1000 * (1 + ("small" in preset)) + 100 * (dtype == "float32") + 10 * (weights == "fp8") + share
    launches = 20 + share + (backend == "reference") * 700
    return dict(launches_per_draft=launches, triton_launches_per_draft=launches - 4,
                kernel_bytes_per_draft=base * 11 + (max_seq_len > 256 and preset == "glm5next_small"),
                floor_bytes_per_draft=base * 10, kernel_floor_ratio=1.1 + (backend == "reference"),
                launches_step_1=launches + 1, kernel_bytes_step_1=base * 12, floor_bytes_step_1=base * 10,
                step_1_unchanged=weights != "fp8")


def test_cells_read_their_own_records():
    seen = []

    def count(key):
        seen.append(key)
        return fake_count(key)

    once = step_tables.cached(count)
    fused = step_tables.fused_table(once)
    assert fused.splitlines()[0] == "| per draft step | tiny bf16 | tiny fp32 | small bf16 | small fp32 |"
    assert "| optimized, fused: kernel bytes / floor | 11,000 / 10,000 = **1.10x** | 12,100 / 11,000 = **1.10x** |" \
        in fused
    assert "| reference (pinned, eager): operators, bytes / floor | 720, 2.1x |" in fused
    nxt = step_tables.next_table(once)
    # glm5next_small's fake step grows by a byte at the larger capacity: the row says so, with the numbers.
    assert "| the same at the other capacity | equal (M 256, 512) | equal (M 256, 512) | M 1024: 20, 22,001 / 20,000" \
        in nxt
    sharing = step_tables.sharing_tables(once)
    assert "| glm5next_tiny bf16 | glm5next_tiny fp8 |" in sharing and "| step 1: launches | 22 | 22 |" in sharing
    assert "| step 1 counts as without sharing | yes | **no** | yes | **no** |" in sharing
    assert len(seen) == len(set(seen)) == 8 + 12 + 8  # each record counted once


def test_unknown_table_is_refused_before_any_count(monkeypatch, capsys):
    monkeypatch.setattr(step_tables, "count_step", lambda key: pytest.fail("counted before the check"))
    with pytest.raises(SystemExit) as e:
        step_tables.main(["--tables", "fused,bogus"])
    assert e.value.code == 2 and "--tables must name some of fused, next, sharing" in capsys.readouterr().err
