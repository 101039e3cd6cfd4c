"""The settings a replay takes from its trace (DESIGN.md §11, docs/traces.md "Replay settings").

A trace fixes what the live run it stands for generated: the mode, the prompts (source, file,
count, length, the seed that placed the windows), the generation budget and the target's
numerics. A replay that left such a key at its config's default takes the trace's value (so a
replay without ``run.max_new_tokens`` generates the 24 tokens the trace was recorded with, not
the config's 64, and its counts are the live run's); one given another value is refused naming
the key, since the trace cannot answer it. The recording's own keys (``trace.out``,
``trace.max_drafts``, ``trace.batch_size``, ``trace.cost_repeats``) and the live target's
(``model.device``, ``model.topk_ties``) are not read by a replay: given, they are refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from ..settings.explicit import given_keys, plain, same, value_at

# key -> where trace.json holds its value (None there: the trace does not fix it, e.g. the
# prompt length of per-prompt jsonl prompts)
FIXED: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "mode": ("mode", lambda m: m.get("mode")),
    "source": ("prompts.source", lambda m: (m.get("prompts") or {}).get("source")),
    "prompts.path": ("prompts.path", lambda m: (m.get("prompts") or {}).get("path")),
    "run.num_prompts": ("prompts.num_prompts", lambda m: (m.get("prompts") or {}).get("num_prompts")),
    "run.prompt_tokens": ("prompts.prompt_tokens", lambda m: (m.get("prompts") or {}).get("prompt_tokens")),
    "seed": ("prompts.seed", lambda m: (m.get("prompts") or {}).get("seed")),
    "run.max_new_tokens": ("generation.max_new_tokens", lambda m: (m.get("generation") or {}).get("max_new_tokens")),
    "target_numerics": ("target.numerics", lambda m: (m.get("target") or {}).get("numerics")),
}
# Keys that can take only a null value from the trace (they are null in a live run of it too).
NULLABLE = ("prompts.path",)
NOT_READ = ("trace.out", "trace.max_drafts", "trace.batch_size", "trace.cost_repeats", "model.device",
            "model.topk_ties")


def take_trace_settings(cfg: Any, meta: dict[str, Any], path: str) -> dict[str, Any]:
    """Set every ``FIXED`` key ``cfg`` left at its default to the trace's value (``meta``: its
    checked ``trace.json``); ``ValueError`` naming the key for a given value the trace does not
    hold, or a ``NOT_READ`` key given. Returns the values taken. Nothing is changed on a refusal."""
    from ..targets.target import TARGET_NUMERICS

    given = set(given_keys(cfg, (*FIXED, *NOT_READ)))
    for key in NOT_READ:
        if key in given:
            raise ValueError(f"{key}={plain(value_at(cfg, key))!r}: a replay (trace.path) does not read it (it "
                             f"records or runs the target, which a replay does neither): leave it unset")
    taken: dict[str, Any] = {}
    for key, (where, get) in FIXED.items():
        want, have = get(meta), plain(value_at(cfg, key))
        if key in given:
            if want is None and key not in NULLABLE:
                raise ValueError(f"{key}={have!r}: the trace at {path} records no {where} to compare it with (a replay "
                                 "takes the trace's settings): leave it unset")
            if not same(have, want):
                raise ValueError(f"{key}={have!r}: the trace at {path} was recorded with {where}={want!r}, and a "
                                 f"replay answers only that: leave {key} unset (the trace's value) or set it to "
                                 f"{want!r}")
            continue
        if want is None and key not in NULLABLE:
            continue
        if key == "target_numerics" and want not in TARGET_NUMERICS:
            continue  # transformers' target: the summary reports the trace's record
        taken[key] = want
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg) if OmegaConf.is_config(cfg) else contextlib.nullcontext():
        for key, value in taken.items():
            *parents, last = key.split(".")
            node = cfg
            for p in parents:
                node = node[p]
            node[last] = value
    return taken


def take_replay_settings(cfg: Any) -> dict[str, Any]:
    """A replay's config (``trace.path`` set) takes its trace's settings (``take_trace_settings``),
    the trace's ``trace.json`` read and checked first. ``ValueError`` naming the key or the field."""
    from .format import TraceError
    from .validate import read_meta

    path = cfg.trace.path
    if not isinstance(path, str) or not path:
        raise ValueError(f"trace.path must be a trace directory or null, got {path!r}")
    try:
        meta = read_meta(path)
    except TraceError as e:
        raise ValueError(f"trace.path: {path}: {e}") from None
    return take_trace_settings(cfg, meta, path)


# The acceptance keys a recording does not read (it runs the target alone, greedy, unconstrained):
# the drafter's, the loop's and the speedup model's. Given, each is refused (it would be ignored).
RECORD_NOT_READ = ("num_drafts", "policy", "draft", "feed_hidden", "attention", "batch_size", "backend.name",
                   "stop.rule", "stop.threshold", "speedup.costs", "speedup.repeats", "run.check_lossless",
                   "model.weights_dtype", "model.index_share", "grammar.drafts", "verify")


def check_recording_settings(cfg: Any) -> None:
    """A recording's config reads no grammar (a trace is the target's unconstrained greedy path,
    which every replayed drafter is verified against: ``grammar=...`` or a ``source=jsonl``
    line's ``json_schema`` would be dropped) and none of ``RECORD_NOT_READ``. ``ValueError``
    naming the key (or the file and line of a per-prompt schema)."""
    node = cfg.get("grammar") or {}
    if node.get("kind", "none") != "none" or node.get("path") is not None or node.get("pattern") is not None:
        given = (f"grammar={node.get('kind')}" if node.get("kind", "none") != "none"
                 else f"grammar.path={node.get('path')!r}" if node.get("path") is not None
                 else f"grammar.pattern={node.get('pattern')!r}")
        raise ValueError(f"{given}: a trace records the target's unconstrained greedy path (every "
                         "replay verifies against it), so a recording takes no grammar: run grammars live "
                         "(python -m glm_mtp.experiments.acceptance grammar=...)")
    for key in given_keys(cfg, RECORD_NOT_READ):
        raise ValueError(f"{key}={plain(value_at(cfg, key))!r}: a recording runs the target alone and does not read "
                         f"{key} (set it on the replay: acceptance trace.path=DIR {key}=...)")


def check_recorded_prompts(cfg: Any) -> None:
    """``source=jsonl`` prompts of a recording carry no ``json_schema`` (the first one is refused,
    naming its file and line): per-prompt schemas constrain a live run only."""
    if cfg.get("source") != "jsonl":
        return
    from ..grammars import jsonl_schemas

    path, num = cfg.prompts.path, cfg.run.num_prompts
    try:
        schemas = jsonl_schemas(path, num)
    except ImportError as e:
        raise ValueError(str(e)) from None
    for i, spec in enumerate(schemas):
        if spec is not None:
            raise ValueError(f"prompts.path: {path}: prompt {i} carries a json_schema, and a trace records the "
                             "target's unconstrained path: record prompts without json_schema (run schemas live)")
