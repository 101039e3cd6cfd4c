"""Which settings a run was given, as against those it left at its config's defaults.

A replay takes the settings its trace fixes from the trace, and a recording reads only some of
the acceptance experiment's keys: a key left at its default follows the trace (or is not read),
one given another value must be honoured or refused, never taken and dropped. Hydra keeps no
record of where a value came from, so a key counts as given when its value differs from the one
its config (``conf/<name>.yaml`` composed with no override but the same ``model`` group) holds: the same test wherever a
config is built (the command line, a sweep's later jobs, the training grid's evaluations, a
test's ``compose``). A key given its default's value is taken as left alone.
"""

from __future__ import annotations

import functools
from typing import Any, cast

# The config each task composes from (``task_name`` -> conf/<name>.yaml).
CONFIGS = {"acceptance": "config", "stop_sweep": "stop_sweep", "record": "config", "train": "train", "grid": "grid",
           "finetune": "finetune"}


def compose_config(name: str, overrides: list[str]) -> Any:
    """``conf/<name>.yaml`` composed with ``overrides`` (inside a Hydra app or outside one)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(name, overrides=overrides)
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose(name, overrides=overrides)


@functools.lru_cache(maxsize=16)
def config_defaults(name: str, model: str | None = None) -> dict[str, Any]:
    """``conf/<name>.yaml`` with no override but the ``model`` group's choice, as plain containers."""
    from omegaconf import OmegaConf

    composed = OmegaConf.to_container(compose_config(name, [f"model={model}"] if model else []), resolve=False)
    assert isinstance(composed, dict)  # a config file composes to a mapping
    return cast(dict[str, Any], composed)


def model_group(cfg: Any) -> str | None:
    """The ``model`` group ``cfg`` was composed with, told by its keys (each group's yaml has its
    own defaults: ``hf``'s ``device``, a shipped checkpoint's ``shipped``)."""
    node = cfg.get("model") or {}
    kind = node.get("kind")
    if kind == "hf":
        return "hf"
    if kind == "random":
        return "tiny_random"
    if kind == "checkpoint":
        return "next_shipped" if "shipped" in node else "shipped"
    return None


_MISSING = object()


def value_at(node: Any, key: str) -> Any:
    """The value at dotted ``key`` of a mapping (a config or a dict), or ``_MISSING``."""
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError, IndexError):
            return _MISSING
        except Exception:  # omegaconf: ??? or a bad interpolation
            return _MISSING
    return node


def plain(x: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x


def given_keys(cfg: Any, keys: tuple[str, ...] | list[str]) -> list[str]:
    """Those of ``keys`` whose value in ``cfg`` differs from its config's default (a key the
    default lacks counts as given when it is set to anything but null)."""
    name = CONFIGS.get(str(cfg.get("task_name", "acceptance")), "config")
    defaults = config_defaults(name, model_group(cfg))
    out = []
    for key in keys:
        have = value_at(cfg, key)
        if have is _MISSING:
            continue
        default = value_at(defaults, key)
        have = plain(have)
        if (default is _MISSING and have is not None) or (default is not _MISSING and not same(have, default)):
            out.append(key)
    return out


def same(a: Any, b: Any) -> bool:
    """Equal as settings (1 and 1.0 alike, a bool never a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b
