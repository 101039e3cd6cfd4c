"""The report's paired differences: which runs pair, and the difference they print."""

import pytest

from glm_mtp.experiments import report


def summary(mode, policy, accepted, prompts_sha="p1", k=2):
    """A run of 3 prompts x 10 steps; ``accepted`` (3, k) per prompt."""
    reached = [[10] + [a[i] for i in range(k - 1)] for a in accepted]
    return {"mode": mode, "source": "heldout", "backend": "reference", "temperature": 0.0, "feed_hidden": "post_norm",
            "policy": policy, "num_drafts": k, "prompts_sha256": prompts_sha, "checkpoint_sha256": "c",
            "counts_per_prompt": {"reached": reached, "accepted": accepted, "steps": [10, 10, 10]}}


def test_pairs_vary_one_setting_on_the_same_prompts():
    runs = [summary("speculative", "first_row_kept", [[6, 3], [7, 4], [5, 2]]),
            summary("speculative", "refeed", [[6, 3], [7, 4], [5, 2]]),
            summary("teacher_forced", "first_row_kept", [[4, 2], [5, 2], [3, 1]]),
            summary("teacher_forced", "refeed", [[4, 2], [5, 2], [3, 1]], prompts_sha="other")]
    by_policy = report.paired_table(runs, "policy").splitlines()[2:]
    # "other" prompts do not pair
    assert len(by_policy) == 1 and by_policy[0].startswith("| refeed − first_row_kept | speculative | heldout")
    by_mode = report.paired_table(runs, "mode").splitlines()[2:]
    assert len(by_mode) == 1 and by_mode[0].startswith("| teacher_forced − speculative | heldout | reference | 0 | "
                                                       "post_norm | first_row_kept | 2 |")
    # alpha_1 = 12/30 - 18/30 = -0.2, the same shift on every prompt: every replicate agrees
    assert by_mode[0].split(" | ")[7] == "-0.200 [-0.20, -0.20]"
    with pytest.raises(ValueError, match="pair"):
        report.paired_table(runs, "colour")


def test_pairs_on_the_draft_and_never_across_it():
    """Runs that differ in ``draft`` (or ``target_numerics``) pair on it, and not when another
    setting is paired; a summary without the key counts as the default."""
    argmax = summary("teacher_forced", "first_row_kept", [[2, 1], [3, 1], [2, 0]])
    sampled = dict(summary("teacher_forced", "first_row_kept", [[7, 4], [6, 3], [8, 5]]), draft="sampled")
    refeed_sampled = dict(summary("teacher_forced", "refeed", [[7, 4], [6, 3], [8, 5]]), draft="sampled")
    rows = report.paired_table([argmax, sampled, refeed_sampled], "draft").splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith("| sampled − argmax | teacher_forced | heldout")
    by_policy = report.paired_table([argmax, sampled, refeed_sampled], "policy").splitlines()[2:]
    assert len(by_policy) == 1 and by_policy[0].startswith("| refeed − first_row_kept")  # the sampled pair only
    assert (
        report.paired_table([argmax, dict(argmax, target_numerics="pinned")], "target_numerics").count(
            "pinned − vendor"
        )
        == 1
    )
