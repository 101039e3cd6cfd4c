"""Hostile values for every argument of the drafter contract, drawn from hypothesis data
(``Draws``): mostly valid ones near a state's row count, the rest across types, dtypes, devices
(``devices``: the CPU, the data-less meta device, CUDA when present), shapes, ranges and special
floats (``SPECIAL_FLOATS``). ``arguments.HostileCalls`` plays them on two backends at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st

from glm_mtp.reference import MtpConfig

SPECIAL_FLOATS = (0.0, -0.0, 1e-45, 1e-40, 1e-38, 1e-30, 0.5, 1.0, 3e38, 3.5e38, 1e39, math.inf, -math.inf, math.nan,
                  -1.0)


def devices() -> list[str]:
    """Devices an argument may live on: the CPU, a data-less meta tensor, CUDA when present."""
    return ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])


class Draws:
    """Argument values for one call, drawn from hypothesis data: mostly valid ones near the
    state's row count (so calls get deep into a sequence), the rest across every kind of wrong."""

    def __init__(self, data: Any, cfg: MtpConfig, dtype: torch.dtype) -> None:
        self.data, self.cfg, self.dtype = data, cfg, dtype

    def draw(self, strategy: st.SearchStrategy) -> Any:
        return self.data.draw(strategy)

    def kind(self, *kinds: str, valid: int = 6) -> str:
        """``"valid"`` with weight ``valid`` among ``kinds``."""
        return self.draw(st.sampled_from(["valid"] * valid + list(kinds)))

    def integer(self, valid: st.SearchStrategy) -> Any:
        """An integer argument: ``valid`` mostly, else negative, huge, a bool, a float, a tensor, a string."""
        k = self.kind("negative", "huge", "bool", "float", "tensor", "float_tensor", "none", "str")
        if k == "valid":
            return self.draw(valid)
        if k == "negative":
            return self.draw(st.integers(-2**70, -1))
        if k == "huge":
            return self.draw(st.sampled_from([2**31, 2**63, 2**70, 10**6]))
        if k == "bool":
            return self.draw(st.booleans())
        if k == "float":
            return self.draw(st.sampled_from([1.0, 2.5, math.nan, math.inf]))
        if k == "tensor":  # on the CPU mostly; on the meta device it holds no value to read
            device = self.draw(st.sampled_from(["cpu", "cpu", *devices()]))
            return torch.tensor(self.draw(valid),
                                dtype=self.draw(st.sampled_from([torch.int64, torch.int32, torch.uint8])),
                                device=device)
        if k == "float_tensor":
            return torch.tensor(float(self.draw(valid)))
        return None if k == "none" else "3"

    def token_id(self) -> int:
        return self.draw(st.integers(0, self.cfg.vocab_size - 1))

    def token(self) -> Any:
        """One token: an int or a tensor of one id, or anything wrong."""
        V = self.cfg.vocab_size
        k = self.kind("out_of_range", "huge", "bool", "float", "tensor", "bad_tensor", "none", valid=5)
        if k == "valid":
            return self.token_id()
        if k == "out_of_range":
            return self.draw(st.sampled_from([-1, V, V + 7, -2**40]))
        if k == "huge":
            return 2**64
        if k == "bool":
            return True
        if k == "float":
            return float(self.token_id())
        if k == "none":
            return None
        value = self.draw(st.sampled_from([self.token_id(), -1, V]))
        if k == "tensor":
            shape = self.draw(st.sampled_from([(), (1,)]))
            dtype = self.draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8, torch.uint32,
                                               torch.uint64]))
            value = value % 256 if dtype.is_signed is False else value
            if shape == (1,) and self.draw(st.integers(0, 5)) == 0:
                return torch.full(shape, value).to_sparse()  # int64: torch has no sparse unsigned tensors
            return torch.full(shape, value, dtype=dtype, device=self.draw(st.sampled_from(devices())))
        shape = self.draw(st.sampled_from([(2,), (1, 1), (0,)]))
        dtype = self.draw(st.sampled_from([torch.int64, torch.float32, torch.bool]))
        return torch.full(shape, value, dtype=dtype) if dtype != torch.bool else torch.ones(shape, dtype=torch.bool)

    def tokens(self, n: int) -> Any:
        """``n`` tokens: a list of ints or a 1-D tensor, or anything wrong."""
        k = self.kind("list_bad_id", "tensor_bad_id", "float_tensor", "2d", "device", "not_a_sequence", "wrong_length",
                      valid=5)
        ids = [self.token_id() for _ in range(n)]
        if k == "valid":
            return (
                ids
                if self.draw(st.booleans())
                else torch.tensor(ids, dtype=self.draw(st.sampled_from([torch.int64, torch.int32])))
            )
        if k == "list_bad_id":
            return ids + [self.draw(st.sampled_from([-1, self.cfg.vocab_size, 1.0, None, True]))]
        if k == "tensor_bad_id":
            return torch.tensor(ids + [self.cfg.vocab_size])
        if k == "float_tensor":
            return torch.tensor(ids, dtype=torch.float32)
        if k == "2d":
            return torch.tensor(ids).reshape(1, -1)
        if k == "device":
            return torch.tensor(ids, device=self.draw(st.sampled_from(devices())))
        if k == "not_a_sequence":
            return self.draw(st.sampled_from([None, 5, "abc"]))
        return ids[:-1] if ids else [0]

    def hiddens(self, rows: int | None) -> Any:
        """Hiddens ``(rows, H)`` (``rows`` None: a single ``(H,)`` or ``(1, H)``), fresh random,
        or of a wrong shape, dtype or device, holding NaN/inf, a view, or not a tensor."""
        H = self.cfg.hidden_size
        shape = (self.draw(st.sampled_from([(H,), (1, H)]))) if rows is None else (rows, H)
        seed = self.draw(st.integers(0, 2**31 - 1))
        base = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul_(
            self.draw(st.sampled_from([1.0, 1.0, 1e-3, 300.0]))
        )
        k = self.kind("dtype", "shape", "nan", "inf", "huge", "device", "view", "sparse", "not_a_tensor", valid=5)
        if k == "valid":
            return base.to(self.dtype)
        if k == "dtype":
            other = self.draw(st.sampled_from([d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                           torch.int64)
                                               if d != self.dtype]))
            return base.to(other)
        if k == "shape":
            return torch.randn(self.draw(st.sampled_from([(H + 1,), (2, H - 1), (0, H), (1, 1, H), ()]))).to(self.dtype)
        if k in ("nan", "inf"):
            t = base.to(self.dtype).reshape(-1, H) if base.numel() else base.to(self.dtype)
            if t.numel():
                t[self.draw(st.integers(0, t.shape[0] - 1)), self.draw(st.integers(0, H - 1))] = (
                    math.nan if k == "nan" else -math.inf
                )
            return t.reshape(shape)
        if k == "huge":  # finite, at the dtype's edge
            return torch.full(shape, torch.finfo(self.dtype).max, dtype=self.dtype)
        if k == "device":
            return base.to(self.dtype).to(self.draw(st.sampled_from(devices())))
        if k == "sparse":
            return base.to(self.dtype).to_sparse()
        if k == "view":  # a strided view of the right shape
            wide = torch.randn(*shape[:-1], 2 * H).to(self.dtype)
            return wide[..., ::2]
        return self.draw(st.sampled_from([None, 1.0, [0.0] * H]))

    def temperature(self) -> Any:
        k = self.kind("special", "int", "bool", "str", valid=4)
        if k == "valid":
            return self.draw(st.floats(0.05, 4.0))
        if k == "special":
            return self.draw(st.sampled_from(SPECIAL_FLOATS))
        if k == "int":
            return self.draw(st.sampled_from([1, 0, -3, 10**400]))
        return True if k == "bool" else "1.0"

    def noise(self, k: int) -> Any:
        V = self.cfg.vocab_size
        seed = self.draw(st.integers(0, 2**31 - 1))
        noise = torch.empty(max(k, 0) if isinstance(k, int) and k < 64 else 1, V).exponential_(
            generator=torch.Generator().manual_seed(seed)
        )
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        kind = self.kind("zero", "nan", "inf", "negative", "tiny", "dtype", "shape", "device", "not_a_tensor", valid=5)
        noise = noise.to(acc)
        if kind == "valid":
            return noise
        if kind in ("zero", "nan", "inf", "negative", "tiny") and noise.numel():
            value = {"zero": 0.0, "nan": math.nan, "inf": math.inf, "negative": -1.0, "tiny": 1e-45}[kind]
            noise[self.draw(st.integers(0, noise.shape[0] - 1)), self.draw(st.integers(0, V - 1))] = value
            return noise
        if kind == "dtype":
            return noise.to(torch.bfloat16 if acc == torch.float32 else torch.float32)
        if kind == "shape":
            return noise[:, :-1]
        if kind == "device":
            return noise.to(self.draw(st.sampled_from(devices())))
        return None if kind == "not_a_tensor" else noise
