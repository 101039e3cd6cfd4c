"""The acceptance run's token windows and prompts by source (``heldout`` and ``ood`` windows cut
from texts, ``text`` files, ``jsonl`` prompts). Used by ``experiments.acceptance``, ``record``,
``stop_sweep``, ``grid`` and ``grid_report``."""

from __future__ import annotations

from typing import Any

import torch

from ..targets.checkpoint import LoadedModel
from .prompts import WINDOW_SOURCES, cut_windows, prompts_path, read_text, text_files, user_prompts


def source_texts(model: LoadedModel, source: str, path: str | None = None) -> list[str]:
    """The texts of a window source: the checkpoint's held-out items, the OOD packages' files, or
    the plain text files at ``path`` (source=text)."""
    from ..training.corpus import ood_items, read_item

    if source == "text":
        if path is None:
            raise ValueError("source=text reads prompts.path (a text file or a folder of them); it is null")
        return [read_text(f) for f in text_files(path)]
    if source == "heldout":
        names = list(model.heldout)
    elif source == "ood":
        names = ood_items()
    else:
        raise ValueError(f"source must be one of {WINDOW_SOURCES} to be cut into windows, got {source!r}")
    texts = []
    for name in names:
        try:
            texts.append(read_item(name))
        except (OSError, KeyError):  # another Python version may lack a file or topic
            continue
    return texts


def build_prompts(model: LoadedModel, num_prompts: int, prompt_tokens: int, seed: int, source: str = "heldout",
                  path: str | None = None) -> list[list[int]]:
    """``num_prompts`` windows of ``prompt_tokens`` tokens, evenly spaced over the source's texts
    (joined as in training); random tokens for a model without a tokenizer."""
    if model.tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, model.mtp.config.vocab_size, (num_prompts, prompt_tokens), generator=gen).tolist()
    stream = model.tokenizer.encode("\n\n".join(source_texts(model, source, path)))
    return cut_windows(stream, num_prompts, prompt_tokens, source)


def run_prompts(cfg: Any, model: LoadedModel, source: str) -> tuple[list[list[int]], list[list[int]]]:
    """The run's token windows and the loop's prompts. Window sources give windows of
    prompt_tokens + max_new_tokens tokens in both modes, so the two modes see the same prompts
    (paired in the report): teacher forcing scores a window's last max_new_tokens positions, the
    loop starts from its first prompt_tokens and generates its own continuation. ``jsonl`` gives
    the user's prompts, whole, as both (``prompts.user_prompts``, which validation read first)."""
    run, path = cfg.run, prompts_path(cfg)
    if source in ("jsonl", "text"):
        if model.tokenizer is None:
            raise ValueError(f"source={source} needs the checkpoint's tokenizer; this model has none")
        return user_prompts(source, path, model.tokenizer, run.num_prompts, run.prompt_tokens, run.max_new_tokens)
    windows = build_prompts(model, run.num_prompts, run.prompt_tokens + run.max_new_tokens, cfg.seed, source, path)
    return windows, [w[: run.prompt_tokens] for w in windows]
