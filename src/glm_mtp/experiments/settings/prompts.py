"""An acceptance run's prompts, by source:

- ``heldout`` / ``ood``: the shipped corpus's held-out items or text never trained on (corpus.py),
  joined, tokenized and cut into evenly spaced windows;
- ``text``: the same from the user's plain text (``prompts.path``: a file, or a folder whose
  files are read in sorted order, hidden ones skipped);
- ``jsonl``: the user's prompts (``prompts.path``: one JSON object a line, ``{"prompt": text}``
  or ``{"messages": [{"role": ..., "content": ...}, ...]}``), each tokenized as the model is
  served it: text with the tokenizer's special tokens, messages through its chat template with
  the generation prompt. Blank lines are skipped. A line may also carry ``"json_schema"``: that
  prompt's output follows the schema (``experiments.grammars``; read there, not here).

Nothing is downloaded: the tokenizer is the checkpoint's own.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

SOURCES = ("heldout", "ood", "text", "jsonl")
WINDOW_SOURCES = ("heldout", "ood", "text")  # cut into windows of prompt + continuation


def text_files(path: str) -> list[str]:
    """``path`` itself when it is a file, else every non-hidden file under it, sorted."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"prompts.path must be a text file or a folder of them, got {path!r}")
    out = []
    for d, dirs, files in os.walk(path):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        out += [os.path.join(d, f) for f in sorted(files) if not f.startswith(".")]
    if not out:
        raise ValueError(f"prompts.path: the folder {path!r} holds no files")
    return out


def read_text(path: str) -> str:
    """A text file's text: UTF-8, else ``ValueError`` naming the file and the first bad byte's
    offset (a file in another encoding would be tokenized as replacement characters)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts.path: {path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") \
            from None


def cut_windows(stream: list[int], num: int, length: int, what: str) -> list[list[int]]:
    """``num`` windows of ``length`` tokens, evenly spaced over ``stream``."""
    if len(stream) < length:
        raise ValueError(f"the {what} source holds {len(stream)} tokens, fewer than prompt_tokens + max_new_tokens = "
                         f"{length}")
    stride = (len(stream) - length) // max(1, num)
    return [stream[i * stride : i * stride + length] for i in range(num)]


def jsonl_prompts(path: str, tokenizer: Any, num: int) -> list[list[int]]:
    """The first ``num`` prompts of a JSONL file, tokenized (fewer when the file holds fewer).
    ``ValueError`` naming the file, the line and the rule for a line that is not a prompt."""
    out: list[list[int]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if len(out) == num:
                break
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e})") from None
            out.append(prompt_tokens(obj, tokenizer, where))
    if not out:
        raise ValueError(f"prompts.path: {path} holds no prompts")
    return out


def prompt_tokens(obj: object, tokenizer: Any, where: str) -> list[int]:
    """One JSONL prompt's tokens: ``prompt`` text or chat ``messages`` (exactly one of them)."""
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{where}: each line must be a JSON object with either \"prompt\" (text) or \"messages\" (a "
                         "chat)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"{where}: \"prompt\" must be non-empty text, got {obj['prompt']!r}")
        ids = tokenizer.encode_prompt(obj["prompt"]) if hasattr(tokenizer,
                                                                "encode_prompt") else tokenizer.encode(obj["prompt"])
    else:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                             and isinstance(m.get("content"), str) for m in msgs):
            raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": text, \"content\": text}}")
        if not hasattr(tokenizer, "encode_chat"):
            raise ValueError(f"{where}: \"messages\" need a chat template, which this model's tokenizer has not (use "
                             "\"prompt\")")
        ids = tokenizer.encode_chat(msgs)
    if not ids:
        raise ValueError(f"{where}: the prompt tokenizes to no tokens")
    return list(ids)


# The fewest tokens a prompt may hold: the drafter's first propose reads the hidden row before the
# last token, and the speedup model times its verifies on the first prompt's first tokens (>= 2).
MIN_PROMPT_TOKENS = 2


def user_prompts(source: str, path: str, tokenizer: Any, num: int, prompt_tokens: int,
                 max_new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The run's windows and the loop's prompts from the user's file: ``jsonl``: its first
    ``num`` prompts, whole, as both; ``text``: ``num`` windows of ``prompt_tokens +
    max_new_tokens`` tokens cut from its texts (joined by blank lines), each prompt a window's
    first ``prompt_tokens``. ``ValueError`` naming the file (and line) and the rule otherwise.

    Args:
        source: ``jsonl`` or ``text``.
        path: ``prompts.path``.
        tokenizer: the checkpoint's tokenizer (``encode``; ``encode_prompt`` / ``encode_chat``
            where it has them).
        num, prompt_tokens, max_new_tokens: ``run.num_prompts``, ``run.prompt_tokens``,
            ``run.max_new_tokens``.
    """
    if source == "jsonl":
        prompts = jsonl_prompts(path, tokenizer, num)
        return prompts, prompts
    stream = tokenizer.encode("\n\n".join(read_text(f) for f in text_files(path)))
    windows = cut_windows(stream, num, prompt_tokens + max_new_tokens, "text")
    return windows, [w[:prompt_tokens] for w in windows]


def check_prompt_lengths(starts: list[list[int]], max_new_tokens: int, num_drafts: int, max_seq_len: int,
                         where: str) -> None:
    """Every prompt holds ``MIN_PROMPT_TOKENS`` or more, and it, its ``max_new_tokens`` and one
    verify of ``num_drafts + 1`` fit ``max_seq_len`` (the target's and the drafter's rows).

    Args:
        starts: the loop's prompts (token ids).
        max_new_tokens, num_drafts: ``run.max_new_tokens``, ``num_drafts``.
        max_seq_len: ``model.max_seq_len``, capped at the model's context.
        where: the prompts' file, as a refusal names it.
    """
    for i, p in enumerate(starts):
        if len(p) < MIN_PROMPT_TOKENS:
            raise ValueError(f"{where}: prompt {i} holds {len(p)} token(s), fewer than {MIN_PROMPT_TOKENS} (too short "
                             "to measure: the drafter reads the hidden row before the last token)")
        need = len(p) + max_new_tokens + num_drafts + 1
        if need > max_seq_len:
            raise ValueError(f"{where}: prompt {i} ({len(p)} tokens) + max_new_tokens + num_drafts + 1 = {need} "
                             f"exceeds model.max_seq_len={max_seq_len}")


def prompts_path(cfg: Any) -> str | None:
    """``prompts.path`` of an acceptance config (None when unset or absent)."""
    node = cfg.get("prompts") or {}
    return node.get("path")


def path_sha256(path: str) -> str:
    """sha256 of a file's bytes; of a folder, of its files' relative names and sha256s, one
    ``name sha256`` a line, in ``text_files`` order."""
    from ..targets.provenance import file_sha256

    if os.path.isfile(path):
        return file_sha256(path)
    lines = "".join(f"{os.path.relpath(f, path)} {file_sha256(f)}\n" for f in text_files(path))
    return hashlib.sha256(lines.encode()).hexdigest()
