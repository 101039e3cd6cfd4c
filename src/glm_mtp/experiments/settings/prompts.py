"""An acceptance run's prompts, by source:

- ``heldout`` / ``ood``: the shipped corpus's held-out items or text never trained on (corpus.py),
  joined, tokenized and cut into evenly spaced windows;
- ``text``: the same from the user's plain text (``prompts.path``: a file, or a folder whose
  files are read in sorted order, hidden ones skipped);
- ``jsonl``: the user's prompts (``prompts.path``: one JSON object a line, ``{"prompt": text}``
  or ``{"messages": [{"role": ..., "content": ...}, ...]}``), each tokenized as the model is
  served it: text with the tokenizer's special tokens, messages through its chat template with
  the generation prompt. Blank lines are skipped.

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
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


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
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if len(out) == num:
                break
            if not line.strip():
                continue
            where = f"{path}:{n}"
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
