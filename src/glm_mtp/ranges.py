"""The ranges of the numbers every command takes, checked where the command reads its settings
(docs/engine.md, "Every command refuses before it works"): a value outside the range its consumer
accepts is refused naming the flag or setting, never passed on to fail deep inside torch.

- seeds: integers in ``[0, SEED_MAX]``: torch's generators take seeds below 2^64, and runs seed
  further generators with small offsets added (``seed + 1``, ``seed + 7``, ``seed + batch``), so
  the bound leaves 2^63 of headroom;
- thread counts: integers in ``[1, THREADS_MAX]`` (``torch.set_num_threads`` takes a C int);
- every other count: an integer ``>=`` its own minimum, at most ``COUNT_MAX`` (a 64-bit count).

``ranged_int(lo, hi)`` is an argparse ``type``: a value outside ``[lo, hi]`` is argparse's
one-line error naming the flag, exit status 2. ``check_int_range`` is the same rule for a
value already read (Hydra settings, ``experiments.settings.validate``). Imports nothing.
"""

from __future__ import annotations

import argparse
from typing import Callable

SEED_MAX = 2**63 - 1
THREADS_MAX = 2**31 - 1
COUNT_MAX = 2**63 - 1


def range_error(lo: int, hi: int | None, value: object) -> str | None:
    """Why ``value`` is not an integer in ``[lo, hi]`` (``hi`` None: ``[lo, COUNT_MAX]``, stated
    as ``>= lo``), or ``None``."""
    bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer {bound}, got {value!r}"
    if value < lo or (hi is not None and value > hi):
        return f"must be {bound}, got {value}"
    if value > COUNT_MAX:
        return f"must be <= {COUNT_MAX} (a 64-bit count), got {value}"
    return None


def check_int_range(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``; ``ValueError`` naming ``name`` and the range otherwise.

    Args:
        name: the flag or setting, as the message names it.
        value: the value read (a bool is not an integer).
        lo, hi: the inclusive range its consumer accepts (``hi`` None: any count up to ``COUNT_MAX``).
    """
    why = range_error(lo, hi, value)
    if why is not None:
        raise ValueError(f"{name} {why}")
    return value  # type: ignore[return-value]  # an int: range_error checked it


def ranged_int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` reading an integer in ``[lo, hi]`` (argparse names the flag).

    Args:
        lo, hi: the inclusive range the flag's consumer accepts (``hi`` None: any count).
    """

    def parse(text: str) -> int:
        try:
            value: object = int(text)
        except ValueError:
            value = text
        why = range_error(lo, hi, value)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return value  # type: ignore[return-value]  # an int: range_error checked it

    return parse
