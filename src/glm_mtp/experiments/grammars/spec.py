"""What grammar a run constrains its output with (DESIGN.md §10), read from the ``grammar`` config
group and from ``source=jsonl`` lines, and checked before any work.

- ``grammar=regex|ebnf|json_schema``: the grammar's text from ``grammar.path=FILE`` or inline
  ``grammar.pattern=TEXT`` (exactly one of them); ``grammar=none`` (the default) constrains nothing.
- ``source=jsonl`` lines may carry ``"json_schema"`` (a JSON object, or its text): that prompt's
  output follows the schema; lines without one are unconstrained. Per-prompt schemas need
  ``grammar=none`` (a run grammar would be a second, conflicting constraint on those prompts).
- ``grammar.drafts``: ``masked`` (the drafter drafts under the grammar, ``propose(...,
  grammar=matcher)``) or ``unmasked`` (the ablation: the drafter drafts freely). The target's
  verification is masked either way, so the output is the same.

A grammar's identity is its kind and the sha256 of its text (UTF-8), which summary.json and W&B
record. Syntax is checked with xgrammar's parser, which needs no tokenizer
(``check_syntax``); compiling against the model's vocabulary is ``grammars.compile``'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("none", "regex", "ebnf", "json_schema")
GRAMMAR_DRAFTS = ("masked", "unmasked")


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar's text and where it came from.

    Args:
        kind: ``regex`` | ``ebnf`` (xgrammar's GBNF dialect, ``root ::= ...``) | ``json_schema``.
        text: the grammar's source text, as read.
        origin: the file it was read from, ``inline`` (grammar.pattern) or ``prompt N`` (a
            source=jsonl line's json_schema, N its 0-based prompt index).
    """

    kind: str
    text: str
    origin: str

    @property
    def sha256(self) -> str:
        """sha256 of the text's UTF-8 bytes: two runs with equal digests used the same grammar."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def record(self) -> dict[str, str]:
        """What summary.json records of the grammar."""
        return {"kind": self.kind, "sha256": self.sha256, "origin": self.origin}


def require_xgrammar() -> Any:
    """xgrammar, or ``ImportError`` naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError:
        raise ImportError("grammars are compiled by xgrammar, which is not installed: pip install "
                          "'glm-mtp[grammar]'") from None
    return xgrammar


def check_syntax(kind: str, text: str, where: str) -> None:
    """``ValueError`` naming ``where`` when ``text`` is not a grammar of ``kind``: a schema that is
    not JSON, or one xgrammar's parser refuses (its first line of message kept)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{where}: the grammar's text is past the bound of {MAX_GRAMMAR_BYTES} bytes")
    if kind == "json_schema":
        from ..reporting.read_back import json_depth

        if json_depth(text) > MAX_SCHEMA_DEPTH:  # xgrammar's converter recurses per level: bounded before it runs
            raise ValueError(f"{where}: a json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: a json_schema must be JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}: a json_schema must be a JSON object (or true/false), got "
                             f"{type(schema).__name__}")
    xgr = require_xgrammar()
    parse = {"regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf,
             "json_schema": xgr.Grammar.from_json_schema}[kind]
    try:
        parse(text)
    except Exception as e:  # xgrammar raises RuntimeError (C++ parse errors) or its own error types
        raise ValueError(f"{where}: not a valid {kind} grammar: {xgrammar_message(e)}") from None
    check_language(kind, text, where)


MAX_GRAMMAR_BYTES = 1 << 20
MAX_SCHEMA_DEPTH = 32


@functools.lru_cache(maxsize=1)
def _byte_compiler() -> Any:
    """xgrammar's compiler over a vocabulary of the 256 single bytes and one stop token (257)."""
    xgr = require_xgrammar()
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"], xgr.VocabType.RAW, vocab_size=257,
                             stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1)


def check_language(kind: str, text: str, where: str) -> None:
    """A grammar must allow some non-empty output: compiled over single bytes, its first mask
    must allow a byte. One that allows only the end (the empty output) or nothing at all would
    constrain every prompt to no token: ``ValueError`` naming ``where``."""
    xgr = require_xgrammar()
    c = _byte_compiler()
    try:
        compiled = {"regex": c.compile_regex, "ebnf": c.compile_grammar,
                    "json_schema": lambda t: c.compile_json_schema(t, any_whitespace=False)}[kind](text)
    except Exception as e:
        raise ValueError(f"{where}: not a valid {kind} grammar: {xgrammar_message(e)}") from None
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    allowed = [(words[j // 32] >> (j % 32)) & 1 for j in range(257)]
    if not any(allowed[:256]):
        what = "only the empty output" if allowed[256] else "no output at all"
        raise ValueError(f"{where}: the {kind} grammar allows {what}; a grammar must allow some text")


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error text without its ``[time] file.cc:line:`` prefix, on one line."""
    msg = " ".join(str(e).split())
    if msg.startswith("[") and ".cc:" in msg:
        msg = msg.split(": ", 1)[-1] if ": " in msg else msg
    return msg


def run_grammar(node: Any) -> GrammarSpec | None:
    """The run's grammar from the ``grammar`` config node (``kind``, ``path``, ``pattern``), read
    and syntax-checked; None for ``kind: none`` (or no node). ``ValueError`` naming the key and
    the rule otherwise. A regex file's one final newline ends its line and is not part of the
    pattern (the text hashed is the pattern used)."""
    if node is None:
        return None
    kind, path, pattern = node.get("kind", "none"), node.get("path"), node.get("pattern")
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"grammar must be one of {', '.join(GRAMMAR_KINDS)}; got {kind!r}")
    drafts = node.get("drafts", "masked")
    if drafts not in GRAMMAR_DRAFTS:
        raise ValueError(f"grammar.drafts must be one of {', '.join(GRAMMAR_DRAFTS)}; got {drafts!r}")
    if kind == "none":
        if path is not None or pattern is not None:
            raise ValueError("grammar.path / grammar.pattern give a grammar's text: choose its kind too "
                             "(grammar=regex, ebnf or json_schema)")
        return None
    if (path is None) == (pattern is None):
        raise ValueError(f"grammar={kind} reads its text from exactly one of grammar.path=FILE or "
                         f"grammar.pattern=TEXT; got path={path!r}, pattern={pattern!r}")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"grammar.pattern must be non-empty text, got {pattern!r}")
        text, origin = pattern, "inline"
    else:
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"grammar.path must be a file holding the {kind} grammar; {path!r} is not a file")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"grammar.path: {path} cannot be read as UTF-8 text ({e})") from None
        if kind == "regex" and text.endswith("\n"):  # a file's one final newline ends its line, not the pattern
            text = text[:-1]
        origin = path
    check_syntax(kind, text, "grammar.pattern" if origin == "inline" else f"grammar.path {path}")
    return GrammarSpec(kind, text, origin)


def prompt_schema(obj: dict[str, Any], index: int, where: str) -> GrammarSpec | None:
    """A ``source=jsonl`` line's ``json_schema`` (an object, or the schema's JSON text), checked;
    None when the line has none. ``where``: ``FILE:LINE`` for messages."""
    if "json_schema" not in obj:
        return None
    schema = obj["json_schema"]
    if isinstance(schema, str):
        text = schema
    elif isinstance(schema, (dict, bool)):
        text = json.dumps(schema)  # key order kept: it orders the properties xgrammar emits
    else:
        raise ValueError(f"{where}: \"json_schema\" must be a JSON schema (an object) or its text, got "
                         f"{type(schema).__name__}")
    check_syntax("json_schema", text, f"{where}: \"json_schema\"")
    return GrammarSpec("json_schema", text, f"prompt {index}")


def jsonl_schemas(path: str, num: int) -> list[GrammarSpec | None]:
    """Each of the first ``num`` prompts' json_schema in a JSONL prompts file (None for lines
    without one), in prompt order, checked; the lines' other content is ``prompts.jsonl_prompts``'
    to check."""
    out: list[GrammarSpec | None] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if len(out) == num:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                out.append(None)  # prompts.jsonl_prompts refuses the line, naming it
                continue
            out.append(prompt_schema(obj, len(out), f"{path}:{n}") if isinstance(obj, dict) else None)
    return out
