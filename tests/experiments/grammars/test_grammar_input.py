"""Grammars are input (issue 49): one that allows only the empty output or nothing at all, a
schema nested past the bound, an undecodable file: refused before work, one line naming the file."""

import json
import random

import pytest

from glm_mtp.experiments.grammars import jsonl_schemas, run_grammar
from glm_mtp.experiments.grammars.spec import MAX_SCHEMA_DEPTH, check_syntax


def node(kind, path=None, pattern=None):
    return {"kind": kind, "path": path, "pattern": pattern, "drafts": "masked"}


@pytest.mark.parametrize("kind, text, words", [
    ("regex", "", "only the empty output"), ("ebnf", 'root ::= ""', "only the empty output"),
    ("regex", "a{0}", "only the empty output"),
])
def test_a_grammar_that_allows_no_text_is_refused_naming_the_file(tmp_path, kind, text, words):
    f = tmp_path / "g.txt"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        run_grammar(node(kind, path=str(f)))
    assert str(f) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_nesting_past_the_bound_and_undecodable_files(tmp_path):
    deep = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    f = tmp_path / "deep.json"
    f.write_text(json.dumps(deep))
    with pytest.raises(ValueError, match=f"{f}.*nests deeper than {MAX_SCHEMA_DEPTH}"):
        run_grammar(node("json_schema", path=str(f)))
    bad = tmp_path / "bad.regex"
    bad.write_bytes(b"[a-\xff]")
    with pytest.raises(ValueError, match=f"grammar.path: {bad} cannot be read as UTF-8"):
        run_grammar(node("regex", path=str(bad)))
    lines = tmp_path / "p.jsonl"
    lines.write_bytes(json.dumps({"prompt": "x"}).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=f"{lines}:2: not UTF-8"):
        jsonl_schemas(str(lines), 5)


def test_drawn_regexes_allow_text_or_are_refused():
    """Drawn small regexes: refused exactly when they match no non-empty text (checked by
    Python's re over every 1- and 2-letter string of the alphabet)."""
    import itertools
    import re

    rng = random.Random(49)
    atoms = ["a", "b", "a?", "b*", "(a|b)", "a{0}", "(ab)?", "[ab]", "()"]
    for _ in range(25):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 3)))
        some = any(re.fullmatch(text, "".join(w)) for n in (1, 2, 3, 4) for w in itertools.product("ab", repeat=n))
        try:
            check_syntax("regex", text, "grammar.pattern")
            assert some, text
        except ValueError as e:
            assert not some and "grammar.pattern" in str(e), (text, str(e))
