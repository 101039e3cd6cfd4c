"""The summary readers answer alike from a current summary.json and from one with the keys older
runs wrote (``lossless_greedy``, ``verify_forwards``, ``grammar_drafts``)."""

import glob
import json
import os

from glm_mtp.experiments.reporting.summary_keys import grammar_drafts, lossless_greedy, verify_forwards

CURRENT = {"lossless": {"prompts": 2, "identical": 1, "diverged": [{"prompt": 1, "token": 3}]},
           "counts": {"reached": [5], "accepted": [2], "steps": 5},
           "grammar": {"kind": "regex", "drafts": "unmasked"}}


def test_current_keys():
    assert lossless_greedy(CURRENT) is False and verify_forwards(CURRENT) == 5 and grammar_drafts(CURRENT) == "unmasked"
    same = {**CURRENT, "lossless": {"prompts": 2, "identical": 2, "diverged": []}, "grammar": None}
    assert lossless_greedy(same) is True and grammar_drafts(same) is None
    assert lossless_greedy({"lossless": None}) is None


def test_old_keys_alone():
    old = {"lossless_greedy": True, "verify_forwards": 7, "grammar": {"kind": "regex"}, "grammar_drafts": "masked"}
    assert lossless_greedy(old) is True and verify_forwards(old) == 7 and grammar_drafts(old) == "masked"


def test_every_stored_summary_reads_alike():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "results")
    paths = glob.glob(os.path.join(root, "**", "summary.json"), recursive=True)
    for path in paths:
        with open(path) as f:
            s = json.load(f)
        if "counts" not in s:
            continue
        if "verify_forwards" in s:
            assert verify_forwards(s) == s["verify_forwards"], path
        if "lossless_greedy" in s:
            assert lossless_greedy(s) == s["lossless_greedy"], path
        if "grammar_drafts" in s:
            assert grammar_drafts(s) == s["grammar_drafts"], path
