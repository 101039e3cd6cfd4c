"""Backend lookup: a name (or a factory) to ``(name, factory)``.

The named backends are the project's registry (``glm_mtp.registry.BACKENDS``); the suite adds
its mutants (``mutant:<name>``) and any importable ``package.module:attr``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from glm_mtp.reference import MtpWeights
from glm_mtp.reference.contract import DraftProposer
from glm_mtp.registry import BACKENDS, backend_class

Factory = Callable[[MtpWeights, int], DraftProposer]


class BackendError(ValueError):
    """A backend name that does not resolve, or a backend that cannot be imported."""


def _registry_factory(name: str) -> Factory:
    try:
        cls = backend_class(name)
    except (ImportError, AttributeError) as e:
        module, attr = BACKENDS[name]
        raise BackendError(f"backend {name!r}: {module}.{attr} is not importable ({type(e).__name__}: {e})") from e
    return lambda w, n: cls(w, n)


def resolve_backend(spec: str | Factory) -> tuple[str, Factory]:
    """``(name, factory)`` for a backend spec.

    Args:
        spec: a name of ``glm_mtp.registry.BACKENDS`` (``"reference"``, ``"optimized"``: its
            package imported only now); ``"mutant:<name>"`` (``mutants.MUTANTS``);
            ``"package.module:attr"`` (a factory or a proposer class); or a factory
            ``(weights, max_seq_len) -> DraftProposer`` itself, named by its import path when
            it has one (so the replay command can name it too).

    Raises:
        BackendError: the name is unknown or its module cannot be imported.
    """
    if callable(spec) and not isinstance(spec, str):
        mod, qual = getattr(spec, "__module__", None), getattr(spec, "__qualname__", None)
        name = f"{mod}:{qual}" if mod and qual and "<" not in qual else repr(spec)
        return name, spec
    if not isinstance(spec, str):
        raise BackendError(f"backend must be a name or a factory, got {type(spec).__name__}")
    if spec in BACKENDS:
        return spec, _registry_factory(spec)
    if spec.startswith("mutant:"):
        from .mutants import MUTANTS

        name = spec.removeprefix("mutant:")
        if name not in MUTANTS:
            raise BackendError(f"backend {spec!r}: unknown mutant {name!r}; known: {sorted(MUTANTS)}")
        cls = MUTANTS[name]
        return spec, lambda w, n: cls(w, n)
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise BackendError(f"backend {spec!r}: cannot import ({type(e).__name__}: {e})") from e
        return spec, obj
    names = ", ".join(sorted(BACKENDS))
    raise BackendError(f"unknown backend {spec!r}; use {names}, mutant:<name> or package.module:attr")
