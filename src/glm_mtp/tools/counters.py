"""Kernel launches and the bytes they move per draft step, measured on CPU.

    TRITON_INTERPRET=1 python -m glm_mtp.tools.counters --preset tiny --dtype bfloat16 --json

(the CLI sets ``TRITON_INTERPRET=1`` itself, re-executing when it was not set.)

``LaunchCounter`` is a context manager that records every kernel a GPU would launch while it is
open, with the bytes each one moves in a DRAM model (a byte read twice within one launch is read
from DRAM once; bytes read and bytes written add):

- **Triton launches**, run by Triton's CPU interpreter (``TRITON_INTERPRET=1``): the
  interpreter's grid executor is wrapped (one record per launch, named after the kernel) and its
  masked load/store (every ``tl.load``/``tl.store``, descriptor and atomic accesses included)
  records the addresses of the lanes whose mask is set, with their element size. A launch's
  bytes = distinct bytes loaded + distinct bytes stored, over all its programs.
- **torch operators** (a ``TorchDispatchMode``, so at the aten level, after the composite ops have
  decomposed, as eager CUDA would run them): one record per operator that would launch a kernel,
  bytes = the distinct storage bytes of its tensor inputs (read) + of its outputs (written); a
  strided tensor counts the bytes its elements cover, not its whole storage. Refinements, all in
  ``torch_op_bytes``: a gather (``index_select``, ``embedding``, ``index``, ``gather``) reads the
  rows it gathers, not its whole source; an index scatter (``index_put_``, ``index_copy_``,
  ``scatter_``) writes the rows it scatters; the destination of a pure write (``copy_``,
  ``fill_``, ``zero_``, random fills, an ``out=`` argument) is not read.

  Not launches (``NOT_LAUNCHES``, counted apart in ``excluded``): views and aliases (``view``,
  ``slice``, ``expand``, ``t``, ``detach``, ... : metadata over the same storage), allocations
  without initialisation (``empty*``, ``new_empty*``, ``resize_``, ``set_``: the caching
  allocator, no kernel), metadata queries (``sym_size``, ``is_contiguous``, ...), host scalars
  (``scalar_tensor``, ``lift_fresh*``: a Python number becomes a kernel argument on a GPU) and the
  host reads (``_local_scalar_dense``: ``.item()``/``.tolist()``, a device-to-host copy, counted
  in ``syncs``), and any operator whose outputs all have zero elements (CUDA launches nothing).
  The torch operators Triton's interpreter itself runs to stage a launch's arguments are not
  counted (the launch is).

``glm_mtp.tools.floor.floor_bytes_per_draft`` is the analytic floor the launches are compared with, and
``measure_draft_step`` counts the marginal draft step of a real propose: counts(propose of 2
drafts) - counts(propose of 1 draft).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from glm_mtp.ranges import SEED_MAX, ranged_int
from glm_mtp.reference.weights import MtpWeights

from .floor import floor_bytes_per_draft

# ------------------------------------------------------------------------------------------------
# Byte footprints: unions of address intervals.


class Footprint:
    """A set of bytes, as sorted disjoint ``[start, end)`` address intervals, merged lazily."""

    COMPACT_AT = 1 << 20  # pending intervals before a merge (keeps a big GEMV's addresses small)

    def __init__(self) -> None:
        self._starts: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []
        self._pending = 0

    def add(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Add intervals ``[starts[i], ends[i])`` (int64 arrays of equal length)."""
        if starts.size == 0:
            return
        self._starts.append(starts.astype(np.int64, copy=False).ravel())
        self._ends.append(ends.astype(np.int64, copy=False).ravel())
        self._pending += starts.size
        if self._pending > self.COMPACT_AT:
            self._compact()

    def add_elements(self, addresses: np.ndarray, size: int) -> None:
        """Add the ``size``-byte elements at ``addresses``."""
        a = np.unique(addresses.astype(np.int64, copy=False).ravel())
        self.add(a, a + size)

    def _compact(self) -> None:
        if len(self._starts) <= 1 and self._pending == 0:
            return
        s, e = np.concatenate(self._starts), np.concatenate(self._ends)
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
        reach = np.maximum.accumulate(e)
        new = np.ones(s.size, dtype=bool)
        new[1:] = s[1:] > reach[:-1]  # touching intervals merge too
        idx = np.flatnonzero(new)
        self._starts, self._ends = [s[idx]], [np.maximum.reduceat(e, idx)]
        self._pending = 0

    @property
    def nbytes(self) -> int:
        if not self._starts:
            return 0
        self._compact()
        return int((self._ends[0] - self._starts[0]).sum())


def tensor_intervals(t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The byte intervals a (strided) tensor's elements cover: one per contiguous run of its
    innermost dense dimensions, or its whole span when that would take over a million runs."""
    es = t.element_size()
    if t.numel() == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    base = t.data_ptr()
    dims = [(s, st) for s, st in zip(t.shape, t.stride()) if s != 1]
    merged: list[list[int]] = []  # [size, stride], outermost first, dense neighbours merged
    for s, st in dims:
        if merged and merged[-1][1] == st * s:
            merged[-1] = [merged[-1][0] * s, st]
        else:
            merged.append([s, st])
    run = 1
    if merged and merged[-1][1] == 1:
        run = merged.pop()[0]
    outer = 1
    for s, _ in merged:
        outer *= s
    if outer > 1 << 20:  # a span (upper bound) rather than a million intervals
        span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1  # torch strides are >= 0
        return np.array([base], np.int64), np.array([base + span * es], np.int64)
    offsets = np.zeros(1, np.int64)
    for s, st in merged:
        offsets = (offsets[:, None] + np.arange(s, dtype=np.int64)[None, :] * st).ravel()
    starts = base + offsets * es
    return starts, starts + run * es


def tensors_bytes(tensors: Iterable[Tensor]) -> int:
    """Distinct bytes the tensors' elements cover, together (a tensor twice counts once)."""
    fp = Footprint()
    for t in tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        fp.add(*tensor_intervals(t))
    return fp.nbytes


# ------------------------------------------------------------------------------------------------
# What a torch operator launches and moves.

# Operators that launch no kernel on a GPU (see the module docstring), by overload packet name.
NOT_LAUNCHES = frozenset({
    # allocation without initialisation: the caching allocator, no kernel
    "aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided",
    "aten.resize_", "aten.set_",
    # views and aliases the schema does not mark as such
    "aten._unsafe_view", "aten.lift_fresh", "aten.alias", "aten.detach", "aten._reshape_alias",
    # metadata queries
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_contiguous",
    "aten.is_same_size", "aten.is_strides_like_format", "aten.is_non_overlapping_and_dense", "aten.dim",
    "aten.size", "aten.stride", "aten.numel",
    # host scalars: a Python number wrapped as a tensor (a kernel argument on a GPU)
    "aten.scalar_tensor", "aten.lift_fresh_copy",
    # device-to-host reads (.item(), .tolist()): a copy and a sync, counted in ``syncs``
    "aten._local_scalar_dense",
})
# Operators that make the host wait for the device.
SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal"})
# Whose first argument is written without being read.
WRITE_ONLY_SELF = frozenset({
    "aten.copy_", "aten.fill_", "aten.zero_", "aten.normal_", "aten.uniform_", "aten.random_", "aten.bernoulli_",
    "aten.exponential_", "aten.index_put_", "aten.index_copy_", "aten.scatter_", "aten._index_put_impl_",
})
# Gathers from their first argument: they read as many of its elements as they output.
GATHERS = frozenset({"aten.index_select", "aten.embedding", "aten.index", "aten.gather", "aten.take"})
# Index scatters into their first argument -> the position of their source values (a tensor, or
# a scalar for ``scatter_.value``): they write one element per source element (or per index).
SCATTERS = {"aten.index_put_": 2, "aten.index_copy_": 3, "aten.scatter_": 3, "aten._index_put_impl_": 2}


def op_name(func: Any) -> str:
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


def is_view_op(func: Any) -> bool:
    """Whether an operator only makes a view or alias of an input (no kernel, no bytes)."""
    if getattr(func, "is_view", False):
        return True
    try:
        returns = func._schema.returns
    except AttributeError:
        return False
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _tensors(x: Any) -> list[Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, Tensor)]


def torch_op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """(bytes read, bytes written) of one operator that launches: distinct bytes of its tensor
    inputs and of its outputs, with the refinements of the module docstring."""
    name = op_name(func)
    schema_args = getattr(getattr(func, "_schema", None), "arguments", [])
    written_args: list[Tensor] = []
    read: list[Tensor] = []
    for i, a in enumerate(args):
        arg_schema = schema_args[i] if i < len(schema_args) else None
        writes = bool(arg_schema is not None and arg_schema.alias_info is not None and arg_schema.alias_info.is_write)
        ts = _tensors(a)
        if writes:
            written_args += ts
            if i == 0 and name in WRITE_ONLY_SELF:
                continue
        read += ts
    for k, v in kwargs.items():
        if k == "out":
            written_args += _tensors(v)
        else:
            read += _tensors(v)
    outs = _tensors(out)
    extra_read = 0
    if name in GATHERS and args and isinstance(args[0], Tensor):
        src = args[0]
        read = [t for t in read if t is not src]
        extra_read = min(sum(t.numel() for t in outs) * src.element_size(), tensors_bytes([src]))
    written_extra = 0
    if name in SCATTERS and args and isinstance(args[0], Tensor):
        dst = args[0]
        outs = [t for t in outs if t.data_ptr() != dst.data_ptr()]
        written_args = [t for t in written_args if t is not dst]
        src_pos = SCATTERS[name]
        values = args[src_pos] if len(args) > src_pos and isinstance(args[src_pos], Tensor) else None
        if name in ("aten.index_put_", "aten._index_put_impl_"):
            idx = [t for t in (args[1] if len(args) > 1 else []) if isinstance(t, Tensor)]
            rows = torch.broadcast_shapes(*(t.shape for t in idx)).numel() if idx else 0
            row = dst[(0,) * len(idx)].numel() if idx and len(idx) <= dst.dim() else 1
            written_extra = min(rows * row * dst.element_size(), tensors_bytes([dst]))
        else:  # index_copy_ / scatter_: one element per source element, or per index for a scalar value
            index = args[2] if len(args) > 2 and isinstance(args[2], Tensor) else None
            n = values.numel() if values is not None else (index.numel() if index is not None else 0)
            written_extra = min(n * dst.element_size(), tensors_bytes([dst]))
    return tensors_bytes(read) + extra_read, tensors_bytes(outs + written_args) + written_extra


# ------------------------------------------------------------------------------------------------
# The counter.


@dataclass
class LaunchRecord:
    """One kernel launch: ``kind`` ``triton`` or ``torch``, the kernel's or operator's name, and
    the bytes it loads and stores (distinct within the launch)."""

    kind: str
    name: str
    bytes_loaded: int
    bytes_stored: int
    grid: tuple[int, ...] | None = None

    @property
    def bytes(self) -> int:
        return self.bytes_loaded + self.bytes_stored


class _TorchOps(TorchDispatchMode):
    def __init__(self, counter: LaunchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if c._in_triton:  # the interpreter staging a launch's arguments: the launch counts
            return out
        name = op_name(func)
        c.dispatched += 1
        if name in SYNC_OPS:
            c.syncs += 1
        if name in NOT_LAUNCHES or is_view_op(func):
            c.excluded[name] += 1
            return out
        outs = _tensors(out)
        if outs and all(t.numel() == 0 for t in outs):
            c.excluded[name + " (empty)"] += 1
            return out
        loaded, stored = torch_op_bytes(func, args, kwargs, out) if c.measure_bytes else (0, 0)
        c.records.append(LaunchRecord("torch", str(func), loaded, stored))
        return out


class _TritonLaunch:
    def __init__(self, name: str) -> None:
        self.name = name
        self.grid: tuple[int, ...] | None = None
        self.loads = Footprint()
        self.stores = Footprint()


class LaunchCounter:
    """Records every kernel launch while open: ``with LaunchCounter() as c: proposer.propose(...)``.

    Args:
        triton: hook Triton's CPU interpreter (needs ``TRITON_INTERPRET=1`` before triton was
            imported; compiled launches on a GPU are not seen).
        torch_ops: count torch operators through a ``TorchDispatchMode``.
        measure_bytes: compute each torch operator's bytes (off: the records carry 0 bytes, for
            a caller that wants only the counts, e.g. a benchmark on a GPU).

    Results: ``records`` (``LaunchRecord`` per launch, in order), ``launches``, ``kernel_bytes``,
    ``by_name()``, ``syncs`` (host reads), ``dispatched`` (every aten operator dispatched, views
    and launches alike) and ``excluded`` (operators seen but not launches). Every patch is
    restored on exit, also on an exception.
    """

    def __init__(self, triton: bool = True, torch_ops: bool = True, measure_bytes: bool = True) -> None:
        self.use_triton = triton
        self.use_torch = torch_ops
        self.measure_bytes = measure_bytes
        self.records: list[LaunchRecord] = []
        self.excluded: Counter[str] = Counter()
        self.syncs = 0
        self.dispatched = 0
        self._in_triton = 0
        self._current: _TritonLaunch | None = None
        self._patches: list[tuple[Any, str, Any]] = []
        self._mode: _TorchOps | None = None

    # ---- results -------------------------------------------------------------------------
    @property
    def launches(self) -> int:
        return len(self.records)

    @property
    def kernel_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def triton_launches(self) -> int:
        return sum(r.kind == "triton" for r in self.records)

    def by_name(self) -> dict[str, dict[str, int]]:
        """``name -> {launches, bytes}``, in order of first launch."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            d = out.setdefault(f"{r.kind}:{r.name}", dict(launches=0, bytes=0))
            d["launches"] += 1
            d["bytes"] += r.bytes
        return out

    # ---- patches -------------------------------------------------------------------------
    def _patch(self, obj: Any, attr: str, new: Any) -> None:
        self._patches.append((obj, attr, obj.__dict__[attr]))
        setattr(obj, attr, new)

    def _hook_triton(self) -> None:
        from triton.runtime import interpreter as interp

        counter = self
        grid_call = interp.GridExecutor.__call__
        set_grid_dim = interp.InterpreterBuilder.set_grid_dim
        masked_load = interp.InterpreterBuilder.create_masked_load
        masked_store = interp.InterpreterBuilder.create_masked_store
        atomic_rmw = interp.InterpreterBuilder.create_atomic_rmw
        atomic_cas = interp.InterpreterBuilder.create_atomic_cas

        def call(self_, *args, **kwargs):
            outer = counter._current
            launch = counter._current = _TritonLaunch(getattr(self_.fn, "__name__", str(self_.fn)))
            counter._in_triton += 1
            try:
                return grid_call(self_, *args, **kwargs)
            finally:
                counter._in_triton -= 1
                counter._current = outer
                counter.records.append(LaunchRecord("triton", launch.name, launch.loads.nbytes, launch.stores.nbytes,
                                                    launch.grid))

        def grid_dim(self_, nx, ny, nz):
            if counter._current is not None:
                counter._current.grid = (int(nx), int(ny), int(nz))
            return set_grid_dim(self_, nx, ny, nz)

        def touched(fp_name: str, ptrs: Any, mask: Any) -> None:
            launch = counter._current
            if launch is None:
                return
            addr = np.asarray(ptrs.data)
            if mask is not None:
                m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
                addr = addr[m]
            size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)  # a bool (i1) is stored in a byte
            getattr(launch, fp_name).add_elements(addr, size)

        def load(self_, ptrs, mask, other, cache_policy, is_volatile):
            touched("loads", ptrs, mask)
            return masked_load(self_, ptrs, mask, other, cache_policy, is_volatile)

        def store(self_, ptrs, value, mask, cache_policy):
            touched("stores", ptrs, mask)
            return masked_store(self_, ptrs, value, mask, cache_policy)

        def rmw(self_, rmwOp, ptr, val, mask, sem, scope):
            touched("loads", ptr, mask)
            touched("stores", ptr, mask)
            return atomic_rmw(self_, rmwOp, ptr, val, mask, sem, scope)

        def cas(self_, ptr, cmp, val, sem, scope):
            touched("loads", ptr, None)
            touched("stores", ptr, None)
            return atomic_cas(self_, ptr, cmp, val, sem, scope)

        self._patch(interp.GridExecutor, "__call__", call)
        self._patch(interp.InterpreterBuilder, "set_grid_dim", grid_dim)
        self._patch(interp.InterpreterBuilder, "create_masked_load", load)
        self._patch(interp.InterpreterBuilder, "create_masked_store", store)
        self._patch(interp.InterpreterBuilder, "create_atomic_rmw", rmw)
        self._patch(interp.InterpreterBuilder, "create_atomic_cas", cas)

    def _restore(self) -> None:
        while self._patches:
            obj, attr, old = self._patches.pop()
            setattr(obj, attr, old)

    def __enter__(self) -> LaunchCounter:
        try:
            if self.use_triton:
                self._hook_triton()
            if self.use_torch:
                self._mode = _TorchOps(self)
                self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
        finally:
            self._restore()


# ------------------------------------------------------------------------------------------------
# A draft step, measured.


def interpreting() -> bool:
    """Whether Triton kernels run through the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def counted(fn: Any, triton: bool = True) -> LaunchCounter:
    with LaunchCounter(triton=triton) as c:
        fn()
    return c


def random_context(weights: MtpWeights, context: int, seed: int,
                   device: torch.device) -> tuple[Tensor, Tensor, int, Tensor]:
    """A counted propose's inputs, drawn from ``seed``: a prompt of ``context + 1`` tokens (C + 1,),
    its hiddens (C + 1, H) in the weights' dtype, and the propose's token and hidden (the last
    of each), so every counter measures the same context for the same seed."""
    cfg = weights.config
    gen = torch.Generator(device).manual_seed(seed + 1)
    prompt = torch.randint(cfg.vocab_size, (context + 1,), generator=gen, device=device)
    hiddens = torch.randn(context + 1, cfg.hidden_size, generator=gen, device=device).to(weights.dtype)
    return prompt, hiddens, int(prompt[-1]), hiddens[-1]


def measure_draft_step(weights: MtpWeights, kernels: str = "triton", *, backend: str = "optimized", context: int = 16,
                       max_seq_len: int = 64, seed: int = 0) -> dict[str, Any]:
    """Launches and bytes of one draft step of ``backend`` (``optimized`` with ``kernels``, or
    ``reference``) on ``weights``: prefill a random context of ``context`` rows, then count a
    propose of 1 draft and one of 2 at the same position (after an uncounted warm-up propose).
    The draft step is the marginal one, counts(2) - counts(1): the second draft, writing slot
    ``context + 1`` with ``context + 2`` rows visible; the per-propose overhead (input checks,
    read-back) is counts(1) - step. The optimized backend's context rows are written by the
    kernels' torch twins (byte-equal; the interpreter is slow, and prefill is not measured).

    Returns a JSON-ready dict: ``launches_per_draft``, ``kernel_bytes_per_draft``,
    ``triton_launches_per_draft``, ``floor_bytes_per_draft`` (at ``context + 2`` visible rows),
    ``kernel_floor_ratio``, ``launches_per_propose_overhead``, ``kernel_bytes_per_propose_overhead``,
    ``syncs_per_draft``, the per-kernel table of the 2-draft propose (``by_name_2``) and of the
    step (``by_name_step``) and the settings. With index sharing (DESIGN.md §9) the counted step
    is a shared one (``shared_step``; its floor leaves out the query side, ``floor.draft_step_bytes``'
    ``selected_at``) and draft step 1 is reported apart (``launches_step_1``, ``kernel_bytes_step_1``,
    ``floor_bytes_step_1``, ``kernel_floor_ratio_step_1``, ``step_1_unchanged``: ``first_step``). With
    ``kernels="triton"`` on CPU it needs ``TRITON_INTERPRET=1`` (set before triton is imported): otherwise it raises
    rather than report no Triton launches.
    """
    from glm_mtp.registry import backend_class

    device = weights.device
    if backend == "optimized":
        if kernels == "triton" and device.type == "cpu" and not interpreting():
            raise RuntimeError("measure_draft_step: kernels='triton' on CPU needs TRITON_INTERPRET=1 set before triton "
                               "is imported (run python -m glm_mtp.tools.counters)")
        if device.type != "cpu" and kernels != "torch":
            raise RuntimeError("measure_draft_step: Triton launches are counted through the CPU interpreter; use "
                               "CPU weights")
        prop = backend_class("optimized")(weights, max_seq_len, kernels=kernels)
        # The context rows come from the kernels' torch twins (byte-equal to them, and not what
        # is measured): the interpreter would spend most of the run there.
        prefiller = backend_class("optimized")(weights, max_seq_len, kernels="torch")
    elif backend == "reference":
        prop = prefiller = backend_class("reference")(weights, max_seq_len)
    else:
        raise ValueError(f"backend must be 'optimized' or 'reference', got {backend!r}")
    prompt, hiddens, token, hidden = random_context(weights, context, seed, device)
    state = prop.alloc_state(device)
    try:
        prefiller.prefill_drafter(prompt, hiddens, state)  # rows [0, context)
        held = prop.drafter_rows(state)

        def propose(k: int) -> Any:
            def go() -> None:
                prop.propose(token, hidden, held, k, state)
            return go

        for k in (1, 2):  # warm-up: one-off tables, caches and static buffers are not a draft step's cost
            propose(k)()
            prop.after_verify(0, state)
        c1 = counted(propose(1))
        prop.after_verify(0, state)
        c2 = counted(propose(2))
        prop.after_verify(0, state)
    finally:
        prop.free_state(state)
    step_launches, step_bytes = c2.launches - c1.launches, c2.kernel_bytes - c1.kernel_bytes
    # fp8 weights: 1 byte a value of each block-scaled matrix plus its scales (DESIGN.md §8);
    # a shared step: the floor without the query side, over step 1's list (made at held + 1 rows)
    sharing = weights.config.index_share_for_mtp_iteration
    floor = floor_bytes_per_draft(weights.config, weights.dtype, held + 2, block_scaled=weights.block_scaled,
                                  selected_at=held + 1 if sharing else None)
    step_1 = first_step(weights, c1, kernels, backend, context, max_seq_len, seed) if sharing else {}
    return dict(
        backend=backend, kernels=kernels if backend == "optimized" else None, preset=cfg_name(weights),
        dtype=str(weights.dtype).removeprefix("torch."), context_rows=held, visible_rows=held + 2,
        max_seq_len=prop.max_seq_len, shared_step=sharing,
        launches_per_draft=step_launches,
        triton_launches_per_draft=c2.triton_launches - c1.triton_launches,
        kernel_bytes_per_draft=step_bytes,
        floor_bytes_per_draft=floor,
        kernel_floor_ratio=step_bytes / floor,
        syncs_per_draft=c2.syncs - c1.syncs,
        launches_per_propose_overhead=c1.launches - step_launches,
        kernel_bytes_per_propose_overhead=c1.kernel_bytes - step_bytes,
        launches_propose_1=c1.launches, launches_propose_2=c2.launches,
        kernel_bytes_propose_1=c1.kernel_bytes, kernel_bytes_propose_2=c2.kernel_bytes,
        by_name_2=c2.by_name(),
        by_name_step=step_by_name(c1, c2),
        excluded_2=dict(c2.excluded),
        **step_1,
    )


def step_by_name(c1: LaunchCounter, c2: LaunchCounter) -> dict[str, dict[str, int]]:
    """The counted draft step's own table, ``c2.by_name()`` less ``c1.by_name()``: each name the
    step launches, with its launches and bytes."""
    one = c1.by_name()
    out = {}
    for name, d in c2.by_name().items():
        launches = d["launches"] - one.get(name, {}).get("launches", 0)
        if launches:
            out[name] = dict(launches=launches, bytes=d["bytes"] - one.get(name, {}).get("bytes", 0))
    return out


def first_step(weights: MtpWeights, c1: LaunchCounter, kernels: str, backend: str, context: int, max_seq_len: int,
               seed: int) -> dict[str, Any]:
    """Draft step 1 of a sharing propose (DESIGN.md §9), whose marginal step is a shared one: the
    same weights counted without sharing, where the marginal step runs the indexer as step 1 does
    (at ``context + 2`` visible rows, like the shared step), and ``step_1_unchanged``: whether a
    1-draft propose (the overhead and step 1) counts the same launches and bytes with sharing as
    without. Returns the ``*_step_1`` fields."""
    plain = measure_draft_step(weights.with_index_share(False), kernels, backend=backend, context=context,
                               max_seq_len=max_seq_len, seed=seed)
    return dict(launches_step_1=plain["launches_per_draft"], triton_launches_step_1=plain["triton_launches_per_draft"],
                kernel_bytes_step_1=plain["kernel_bytes_per_draft"], floor_bytes_step_1=plain["floor_bytes_per_draft"],
                kernel_floor_ratio_step_1=plain["kernel_floor_ratio"],
                step_1_unchanged=((c1.launches, c1.kernel_bytes)
                                  == (plain["launches_propose_1"], plain["kernel_bytes_propose_1"])))


def measure_batch_step(weights: MtpWeights, batch: int, kernels: str = "triton", *, context: int = 16,
                       max_seq_len: int = 64,
                       seed: int = 0) -> dict[str, Any]:
    """Launches and bytes of one batched draft step (``propose_batch``) over ``batch`` states,
    measured as ``measure_draft_step`` measures one state's: counts(k=2) - counts(k=1), after an
    uncounted warm-up. State b holds ``context + 3 * b`` rows (sequences at different lengths).

    Returns ``launches_per_step``, ``kernel_bytes_per_step`` (distinct bytes each launch reads or
    writes, summed over the launches: a weight read for every row of the batch counts once),
    ``kernel_bytes_per_row`` (per state), ``syncs_per_step`` and the settings."""
    from glm_mtp.registry import backend_class

    device = weights.device
    if kernels == "triton" and device.type == "cpu" and not interpreting():
        raise RuntimeError("measure_batch_step: kernels='triton' on CPU needs TRITON_INTERPRET=1 set before triton is "
                           "imported")
    prop = backend_class("optimized")(weights, max_seq_len, kernels=kernels, max_batch=max(batch, 1))
    prefiller = backend_class("optimized")(weights, max_seq_len, kernels="torch")
    cfg = weights.config
    gen = torch.Generator(device).manual_seed(seed + 1)
    states = [prop.alloc_state(device) for _ in range(batch)]
    try:
        held = []
        for b, st in enumerate(states):
            n = context + 3 * b + 1
            if n + 3 > prop.capacity:
                raise ValueError(f"measure_batch_step: state {b} holds {n - 1} rows, past the capacity "
                                 f"{prop.capacity}; raise max_seq_len")
            prompt = torch.randint(cfg.vocab_size, (n,), generator=gen, device=device)
            hiddens = torch.randn(n, cfg.hidden_size, generator=gen, device=device).to(weights.dtype)
            prefiller.prefill_drafter(prompt, hiddens, st)
            held.append(prop.drafter_rows(st))
        tokens = torch.randint(cfg.vocab_size, (batch,), generator=gen, device=device).tolist()
        hidden = torch.randn(batch, cfg.hidden_size, generator=gen, device=device).to(weights.dtype)

        def propose(k: int) -> Any:
            def go() -> None:
                prop.propose_batch(tokens, hidden, held, k, states)
            return go

        def verify() -> None:
            for st in states:
                prop.after_verify(0, st)

        # allocated on first use: not a step's cost
        prop.batch_buffers(device).out(1), prop.batch_buffers(device).out(2)
        for k in (1, 2):  # warm-up: one-off tables, caches, static buffers (and host reads) are not a step cost
            propose(k)()
            verify()
        c1 = counted(propose(1))
        verify()
        c2 = counted(propose(2))
        verify()
    finally:
        for st in states:
            prop.free_state(st)
    step_bytes = c2.kernel_bytes - c1.kernel_bytes
    return dict(
        kernels=kernels, preset=cfg_name(weights), dtype=str(weights.dtype).removeprefix("torch."), batch=batch,
        context_rows=held, max_seq_len=prop.max_seq_len,
        launches_per_step=c2.launches - c1.launches, triton_launches_per_step=c2.triton_launches - c1.triton_launches,
        kernel_bytes_per_step=step_bytes, kernel_bytes_per_row=step_bytes / max(batch, 1),
        syncs_per_step=c2.syncs - c1.syncs,
        launches_per_propose_overhead=2 * c1.launches - c2.launches,
        by_name_2=c2.by_name(),
    )


class BanMatcher:
    """A matcher (DESIGN.md §10) that allows every token except ``banned[i]`` at draft i (0-based
    depth), never terminates, and fills its bitmask through numpy (host work, not a torch
    operator: what is counted is the drafter's). The counters' allowing (nothing banned) and
    forbidding (the unmasked draft 1 or 2 banned) grammars."""

    def __init__(self, banned: dict[int, int] | None = None) -> None:
        self.banned = dict(banned or {})
        self.depth = 0

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int = 0) -> None:
        words = bitmask.numpy()
        words[index] = -1
        t = self.banned.get(self.depth)
        if t is not None:
            words[index, t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)

    def accept_token(self, token: int) -> bool:
        self.depth += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.depth -= num_tokens


def measure_grammar_propose(weights: MtpWeights, kernels: str = "triton", *, num_drafts: int = 3, context: int = 16,
                            max_seq_len: int = 64, seed: int = 0) -> dict[str, Any]:
    """Launches, host syncs and bytes of one optimized ``propose`` of ``num_drafts`` drafts
    (DESIGN.md §10, §12), per case, at the same inputs after an uncounted warm-up: ``none`` (no
    grammar), ``allowing`` (a grammar that allows every unmasked draft), ``forbid_1`` /
    ``forbid_2`` (one that forbids exactly the unmasked draft 1 / 2: a redo from that step), and
    ``confidence`` (``draft_confidence`` after a propose without a grammar, counted alone) and
    ``confidence_masked`` (after the ``forbid_2`` propose). ``read_backs``: the proposer's
    device-to-host reads (its ``read_back``; on a CPU tensor ``tolist`` runs no operator, so the
    counter cannot see them); ``counter_syncs``: ``LaunchCounter.syncs``, the host scalar reads of
    any tensor (with the Triton kernels: ``route_launch``'s float() of a CPU scalar, one per
    step, a host tensor on a GPU too). Returns a JSON-ready dict with the drafts of each case."""
    from glm_mtp.optimized import proposer as opt_proposer
    from glm_mtp.registry import backend_class

    device = weights.device
    if kernels == "triton" and device.type == "cpu" and not interpreting():
        raise RuntimeError("measure_grammar_propose: kernels='triton' on CPU needs TRITON_INTERPRET=1 set before "
                           "triton is imported (run python -m glm_mtp.tools.counters)")
    prop = backend_class("optimized")(weights, max_seq_len, kernels=kernels)
    prefiller = backend_class("optimized")(weights, max_seq_len, kernels="torch")
    prompt, hiddens, token, hidden = random_context(weights, context, seed, device)
    state = prop.alloc_state(device)
    reads: list[int] = []
    real = opt_proposer.read_back

    def spy(t: Tensor) -> list[int]:
        reads.append(t.numel())
        return real(t)

    out: dict[str, Any] = {}
    try:
        prefiller.prefill_drafter(prompt, hiddens, state)
        held = prop.drafter_rows(state)
        plain = prop.propose(token, hidden, held, num_drafts, state)  # warm-up
        prop.after_verify(0, state)
        cases = {"none": None, "allowing": BanMatcher(), "forbid_1": BanMatcher({0: plain[0]}),
                 "forbid_2": BanMatcher({1: plain[1]})}
        opt_proposer.read_back = spy
        for name, grammar in cases.items():
            reads.clear()
            with LaunchCounter() as c:
                drafts = prop.propose(token, hidden, held, num_drafts, state, grammar=grammar)
            out[name] = dict(launches=c.launches, triton_launches=c.triton_launches, kernel_bytes=c.kernel_bytes,
                             read_backs=len(reads), counter_syncs=c.syncs, drafts=drafts)
            if name in ("none", "forbid_2"):
                reads.clear()
                with LaunchCounter() as c:
                    prop.draft_confidence(state)
                out["confidence" if name == "none" else "confidence_masked"] = dict(
                    launches=c.launches, triton_launches=c.triton_launches, kernel_bytes=c.kernel_bytes,
                    read_backs=len(reads), counter_syncs=c.syncs, by_name=c.by_name())
            prop.after_verify(0, state)
    finally:
        opt_proposer.read_back = real
        prop.free_state(state)
    V = weights.config.vocab_size
    return dict(kernels=kernels, preset=cfg_name(weights), dtype=str(weights.dtype).removeprefix("torch."),
                num_drafts=num_drafts, context_rows=held, unmasked_drafts=plain, vocab_size=V,
                logits_bytes_per_step=V * weights.dtype.itemsize, **out)


def cfg_name(weights: MtpWeights) -> str | None:
    """The preset whose values ``weights.config`` has, if any."""
    from glm_mtp.reference.config import PRESETS, MtpConfig

    for name in PRESETS:
        try:
            if dataclasses.asdict(MtpConfig.preset(name)) == dataclasses.asdict(weights.config):
                return name
        except (TypeError, ValueError):
            continue
    return None


def counters_parser() -> argparse.ArgumentParser:
    """The counters' flags (``checked_weights`` checks them)."""
    p = argparse.ArgumentParser(prog="python -m glm_mtp.tools.counters",
                                description="Kernel launches and bytes per draft step, counted in Triton's CPU "
                                            "interpreter.")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="optimized", choices=["optimized", "reference"])
    p.add_argument("--kernels", default="triton", choices=["triton", "torch", "auto"])
    p.add_argument("--context", type=int, default=16, help="rows held before the proposes")
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--seed", type=ranged_int(0, SEED_MAX), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object (else a short table)")
    p.add_argument("--weights", default="plain", choices=["plain", "fp8"],
                   help="plain (every weight in --dtype) or fp8 (the DESIGN.md §8 matrices block-scaled by "
                        "quantize_fp8)")
    p.add_argument("--index-share", default="preset", choices=["preset", "true", "false"],
                   help="index sharing across draft steps (DESIGN.md §9): the preset's, or on / off; with it on, the "
                        "counted draft step is a shared one and draft step 1 is reported apart (*_step_1)")
    p.add_argument("--grammar", action="store_true",
                   help="count one propose with no grammar, an allowing one and ones forbidding draft 1 or 2 "
                        "(DESIGN.md §10), and draft_confidence (§12): launches, syncs, bytes per propose")
    p.add_argument("--batch", type=int, default=None,
                   help="measure one batched draft step (propose_batch) over this many states instead (optimized "
                        "backend)")
    return p


def checked_weights(p: argparse.ArgumentParser, a: argparse.Namespace) -> MtpWeights:
    """Every flag checked before anything is counted (``p.error``: exit status 2, one line naming
    the flag): the preset and its context, the dtype, the rows a measurement holds against the
    drafter's capacity, ``--batch``; then the weights, and the drafter built once on them, so a
    combination it refuses (fp8 weights in a storage dtype its kernels do not take) is named."""
    from glm_mtp.reference import MtpConfig
    from glm_mtp.registry import DTYPES, backend_class, parse_dtype

    try:
        cfg = MtpConfig.preset(a.preset)
    except ValueError as e:
        p.error(f"--preset: {e}")
    if a.max_position_embeddings is not None:
        try:
            cfg = cfg.replace(max_position_embeddings=a.max_position_embeddings)
        except ValueError as e:
            p.error(f"--max-position-embeddings {a.max_position_embeddings}: {e}")
    if a.dtype not in DTYPES:
        p.error(f"--dtype must be a weight dtype ({', '.join(DTYPES)}), got {a.dtype!r}")
    if a.batch is not None and (a.batch < 1 or a.backend != "optimized"):
        p.error("--batch must be >= 1, with --backend optimized")
    if a.context < 1 or a.context + 4 > a.max_seq_len:
        p.error("--context must be >= 1 and --max-seq-len >= --context + 4")
    held = a.context + 4 + (3 * (a.batch - 1) if a.batch else 0)  # the batched states hold 3 more rows each
    if held > cfg.max_position_embeddings:
        p.error(f"--context {a.context}: a measurement holds {held} rows, past preset {a.preset}'s context "
                f"(max_position_embeddings {cfg.max_position_embeddings}, which caps --max-seq-len); lower --context "
                "or raise --max-position-embeddings")
    weights = MtpWeights.random(cfg, seed=a.seed, dtype=parse_dtype(a.dtype), device="cpu")
    if a.weights == "fp8":
        weights = weights.quantize_fp8()
    try:
        backend_class(a.backend)(weights, a.max_seq_len)
    except ValueError as e:
        p.error(f"--backend {a.backend} --weights {a.weights} --dtype {a.dtype}: {e}")
    return weights


def main(argv: list[str] | None = None) -> None:
    p = counters_parser()
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    weights = checked_weights(p, a)
    weights = weights.with_index_share(None if a.index_share == "preset" else a.index_share == "true")
    if a.grammar:
        result = measure_grammar_propose(weights, a.kernels, context=a.context, max_seq_len=a.max_seq_len,
                                         seed=a.seed)
        if a.json:
            print(json.dumps(result))
            return
        print(f"{a.preset} {a.dtype} optimized propose of {result['num_drafts']} drafts ({a.kernels}):")
        for name in ("none", "allowing", "forbid_1", "forbid_2", "confidence", "confidence_masked"):
            d = result[name]
            print(f"  {name:18s} {d['launches']:5d} launches ({d['triton_launches']} Triton) "
                  f"{d['read_backs']:2d} read-backs {d['counter_syncs']:2d} host scalar reads "
                  f"{d['kernel_bytes']:10d} bytes")
        return
    if a.batch is not None:
        result = measure_batch_step(weights, a.batch, a.kernels, context=a.context, max_seq_len=a.max_seq_len,
                                    seed=a.seed)
        result["preset"] = a.preset
        if a.json:
            print(json.dumps(result))
        else:
            print(f"{a.preset} {a.dtype} batch {a.batch}: {result['launches_per_step']} launches/step, "
                  f"{result['kernel_bytes_per_step']} bytes/step ({result['kernel_bytes_per_row']:.0f} per row)")
        return
    result = measure_draft_step(weights, a.kernels, backend=a.backend, context=a.context, max_seq_len=a.max_seq_len,
                                seed=a.seed)
    result["preset"], result["weights"] = a.preset, a.weights
    result["index_share"] = weights.config.index_share_for_mtp_iteration
    if a.json:
        print(json.dumps(result))
        return
    print(f"{a.preset} {a.dtype} ({a.weights} weights) {a.backend}: {result['launches_per_draft']} launches/draft "
          f"({result['triton_launches_per_draft']} Triton), {result['kernel_bytes_per_draft']} bytes/draft, "
          f"floor {result['floor_bytes_per_draft']} bytes (x{result['kernel_floor_ratio']:.2f}); "
          f"per propose +{result['launches_per_propose_overhead']} launches, "
          f"+{result['kernel_bytes_per_propose_overhead']} bytes")
    if result["shared_step"]:
        print(f"  (a shared step; draft step 1: {result['launches_step_1']} launches, "
              f"{result['kernel_bytes_step_1']} bytes, floor {result['floor_bytes_step_1']} bytes "
              f"(x{result['kernel_floor_ratio_step_1']:.2f}))")
    for name, d in sorted(result["by_name_2"].items(), key=lambda kv: -kv[1]["bytes"])[:25]:
        print(f"  {d['launches']:5d} x {name:60s} {d['bytes']:12d} B")


if __name__ == "__main__":
    if not interpreting():
        # Triton was imported with the package, before this line: start again with the variable set.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "glm_mtp.tools.counters", *sys.argv[1:]])
    main()
