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


def test_the_table_says_what_alpha_and_cumulative_count():
    """Under the table, after a blank line (Markdown ends the table there), the legend of the
    acceptance columns it shows: α_i over the rounds that verified draft i, P(acc ≥ i) over all
    rounds, and that a stop rule makes them differ; each view only its own columns'."""
    from glm_mtp.experiments.reporting.legend import ALPHA_LEGEND, CUMULATIVE_LEGEND, STOP_RULE_NOTE

    run = {"mode": "speculative", "source": "heldout", "backend": "reference", "temperature": 0.0,
           "feed_hidden": "post_norm", "policy": "first_row_kept", "num_drafts": 2, "prompts": 3,
           "acceptance_per_position": [1.0, 0.5], "cumulative": [0.2, 0.1], "mean_accepted_length": 1.3,
           "generated_tokens": 30}  # a stop rule's row: α_1 1.000 beside P(acc ≥ 1) 0.200
    table, legend = report.markdown_table([run]).split("\n\n")
    assert all(line.startswith("|") for line in table.splitlines())
    assert legend == f"{ALPHA_LEGEND}; {CUMULATIVE_LEGEND}; {STOP_RULE_NOTE}"
    assert "the rounds that verified draft i" in legend and "of all rounds" in legend and "stop rule" in legend
    conditional = report.markdown_table([run], "conditional").split("\n\n")[1]
    cumulative = report.markdown_table([run], "cumulative").split("\n\n")[1]
    assert conditional == ALPHA_LEGEND and "P(acc" not in conditional
    assert cumulative == CUMULATIVE_LEGEND and "α_i" not in cumulative
