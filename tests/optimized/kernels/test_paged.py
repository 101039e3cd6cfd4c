"""The per-row address tables (optimized/kernels/paged.py): ``RowCaches`` (where each row of a
cache kernel finds its sequence's paged pools) and ``scatter_rows`` (the batched programs' write
of each row into its own state's tensor), the kernel against its twin byte for byte through the
interpreter, on fresh random values; a mutant that writes every row through line 0 is caught."""

import pytest
import torch

from glm_mtp.optimized.kernels import paged
from glm_mtp.optimized.kernels.paged import (
    ADDRESS_COLUMNS, RowCaches, RowTargets, cache_addresses, row_caches, scatter_rows_torch, scatter_rows_triton,
)
from glm_mtp.reference import MtpConfig
from glm_mtp.reference.bytes import bits
from glm_mtp.reference.state import LayerCache

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=["fp32", "bf16", "int64"])


def _values(gen, T, N, dtype):
    if dtype == torch.int64:
        return torch.randint(-2**62, 2**62, (T, N), generator=gen, dtype=torch.int64)
    v = torch.randn(T, N, generator=gen).to(dtype)
    v[0, 0] = float("nan")
    v[-1, -1] = -0.0
    return v


@DTYPES
@pytest.mark.parametrize("ok", [True, False])
def test_scatter_rows_kernel_equals_twin(dtype, ok):
    gen = torch.Generator().manual_seed(7)
    T, N = 5, 1100  # N past one block of 1024: the loop's masked tail
    values = _values(gen, T, N, dtype)
    dst_k = [_values(gen, 1, N, dtype).reshape(N) for _ in range(T)]
    dst_t = [d.clone() for d in dst_k]
    before = [d.clone() for d in dst_k]
    flag = torch.tensor([ok])
    column = torch.zeros(8, 2, dtype=torch.int64)[:, 1]  # a strided column of a table
    scatter_rows_triton(values, RowTargets.of(dst_k, column), flag)
    scatter_rows_torch(values, RowTargets.of(dst_t, column), flag)
    for t in range(T):
        assert torch.equal(bits(dst_k[t]), bits(dst_t[t]))
        assert torch.equal(bits(dst_k[t]), bits(values[t] if ok else before[t]))


def test_scatter_rows_mutant_every_row_through_line_zero_is_caught():
    gen = torch.Generator().manual_seed(8)
    values = _values(gen, 3, 16, torch.float32)
    dst = [torch.zeros(16) for _ in range(3)]
    good = RowTargets.of(dst, torch.zeros(3, dtype=torch.int64))
    broken = RowTargets(good.tensors, good.addresses[:1].expand(3))  # stride 0: every row to dst[0]
    scatter_rows_triton(values, broken, torch.tensor([True]))
    assert not torch.equal(bits(dst[1]), bits(values[1]))
    scatter_rows_triton(values, good, torch.tensor([True]))
    assert all(torch.equal(bits(dst[t]), bits(values[t])) for t in range(3))


def test_scatter_rows_refuses_mismatched_targets():
    values = torch.ones(2, 4)
    with pytest.raises(ValueError, match="targets.tensors\\[1\\]"):
        paged.scatter_rows_launch(values,
                                  RowTargets((torch.zeros(4), torch.zeros(5)), torch.zeros(2, dtype=torch.int64)),
                                  torch.tensor([True]))


def test_row_caches_tables_and_runs():
    cfg = MtpConfig.preset("tiny")
    caches = [LayerCache.allocate(cfg, 3, torch.float32, "cpu") for _ in range(3)]
    one = row_caches(caches[0])
    assert one.stride == 0 and one.addresses.tolist() == [cache_addresses(caches[0])]
    rows = [caches[0], caches[0], caches[2], caches[1], caches[1]]
    table = torch.full((8, ADDRESS_COLUMNS), -1, dtype=torch.int64)
    rc = RowCaches.per_row(rows, table)
    assert rc.stride == ADDRESS_COLUMNS and rc.addresses.data_ptr() == table.data_ptr()
    assert table[:5].tolist() == [cache_addresses(c) for c in rows] and table[5:].eq(-1).all()
    assert [(c is caches[i], s) for (c, s), i in zip(rc.runs(5), (0, 2, 1))] == [
        (True, slice(0, 2)), (True, slice(2, 3)), (True, slice(3, 5))]
    assert rc.cache_of(3) is caches[1] and one.cache_of(4) is caches[0]
    with pytest.raises(ValueError, match="table must be int64"):
        RowCaches.per_row(rows, torch.zeros(4, 3, dtype=torch.int64))
    # A GLM-5 line has no KPool cache (0s, never read); a glm5_next line names its three tensors.
    assert cache_addresses(caches[0])[3:] == [0, 0, 0]
    nxt = LayerCache.allocate(MtpConfig.preset("glm5next_tiny"), 3, torch.float32, "cpu")
    kp = nxt.kpool
    assert cache_addresses(nxt)[3:] == [kp.gates.data_ptr(), kp.keys.data_ptr(), kp.complete.data_ptr()]


def test_a_misaligned_pool_is_refused():
    """The kernels declare every table address 16-byte aligned (row_pools): a pool view at an odd
    offset must be refused on the host, never passed on."""
    cfg = MtpConfig.preset("tiny")
    c = LayerCache.allocate(cfg, 3, torch.bfloat16, "cpu")
    room = torch.zeros(c.kv_pool.numel() + 1, dtype=torch.bfloat16)
    odd = LayerCache(room[1:].view(c.kv_pool.shape), c.index_pool, c.block_table)
    with pytest.raises(ValueError, match="kv_pool starts 2 bytes past a 16-byte boundary"):
        RowCaches.of(odd)
    with pytest.raises(ValueError, match="16-byte boundary"):
        RowCaches.per_row([c, odd])
