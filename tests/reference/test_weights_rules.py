"""Weights are checked wherever they are made (``random``, ``to``, ``from_pretrained``,
``shard``, the constructor): a weight dtype the drafter computes in, one device, a cast that
keeps every finite weight finite, and every argument validated with an error naming it."""

from __future__ import annotations

import os

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.weights import same_bytes


@pytest.fixture(scope="module")
def cfg() -> MtpConfig:
    return MtpConfig.preset("tiny")


@pytest.fixture(scope="module")
def bf16(cfg) -> MtpWeights:
    return MtpWeights.random(cfg, seed=4, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype",
                         [torch.int8, torch.int64, torch.bool, torch.float8_e4m3fn, torch.complex64, "bfloat16", None])
def test_random_and_to_refuse_a_dtype_the_drafter_cannot_compute_in(cfg, bf16, dtype):
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        MtpWeights.random(cfg, dtype=dtype)
    if dtype is not None:  # to(dtype=None) keeps the dtype
        with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
            bf16.to(dtype=dtype)


def test_random_refuses_a_bad_device_and_seed(cfg):
    with pytest.raises(ValueError, match="device"):
        MtpWeights.random(cfg, device="gpu7")
    with pytest.raises(ValueError, match="seed must be an integer"):
        MtpWeights.random(cfg, seed=1.5)


def test_the_constructor_refuses_mixed_dtypes_and_devices(bf16):
    import dataclasses
    with pytest.raises(ValueError, match="'lm_head' has dtype torch.float32; every weight must be torch.bfloat16"):
        dataclasses.replace(bf16, lm_head=bf16.lm_head.float())
    with pytest.raises(ValueError, match="'enorm' is on meta"):
        dataclasses.replace(bf16, enorm=bf16.enorm.to("meta"))
    with pytest.raises(ValueError, match="floating torch.dtype"):
        dataclasses.replace(bf16, eh_proj=bf16.eh_proj.to(torch.int8))


def test_to_refuses_a_cast_that_overflows_a_finite_weight(bf16):
    big = bf16.to(dtype=torch.bfloat16)
    big.lm_head[3, 5] = 1e6  # finite in bfloat16, inf in float16
    with pytest.raises(ValueError,
                       match=r"'lm_head.weight': casting torch.bfloat16 to torch.float16 overflows 1 finite value"):
        big.to(dtype=torch.float16)
    assert same_bytes(bf16.to(dtype=torch.float32).to(dtype=torch.bfloat16).lm_head, bf16.lm_head)


def test_from_pretrained_checks_the_weights_it_returns(bf16, tmp_path):
    """A bfloat16 checkpoint cast to float16 that overflows: the finite rule holds for the
    returned weights (it held only for the ones read)."""
    big = bf16.to(dtype=torch.bfloat16)
    big.eh_proj[0, 0] = -7e4
    big.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"eh_proj.weight'?: casting torch.bfloat16 to torch.float16 overflows"):
        MtpWeights.from_pretrained(tmp_path / "ckpt", dtype=torch.float16)
    w = MtpWeights.from_pretrained(tmp_path / "ckpt", dtype=torch.float16, allow_non_finite=True)  # an inspection
    assert torch.isinf(w.eh_proj[0, 0])
    assert MtpWeights.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eh_proj[0, 0] == big.eh_proj[0, 0].float()


@pytest.fixture(scope="module")
def checkpoint(bf16, tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "ckpt"
    bf16.save_pretrained(path)
    return path


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=torch.int8), "from_pretrained: dtype must be a floating torch.dtype"),
    (dict(device="gpu7"), "from_pretrained: device"),
    (dict(device=3.0), "from_pretrained: device must be a torch.device"),
    (dict(ep_world=0), r"from_pretrained: ep_world must be >= 1"),
    (dict(ep_world=2.0), r"from_pretrained: ep_world must be an integer"),
    (dict(ep_rank=-1), r"from_pretrained: ep_rank must be >= 0"),
    (dict(ep_rank=3), r"from_pretrained: ep_rank must be in \[0, ep_world=1\)"),
    (dict(ep_rank=2, ep_world=2), r"from_pretrained: ep_rank must be in \[0, ep_world=2\)"),
    (dict(ep_rank=True, ep_world=2), r"from_pretrained: ep_rank must be an integer"),
    (dict(ep_world=2, row_parallel_o_proj="yes"), r"from_pretrained: row_parallel_o_proj must be a bool"),
    (dict(ep_world=3, row_parallel_o_proj=False), r"from_pretrained: ep_world=3 must divide"),
    (dict(allow_non_finite=1), r"from_pretrained: allow_non_finite must be a bool"),
])
def test_from_pretrained_validates_every_argument_naming_it(checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MtpWeights.from_pretrained(checkpoint, **kwargs)


def test_from_pretrained_refuses_paths_that_are_not_checkpoint_directories(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        MtpWeights.from_pretrained(tmp_path / "nonexistent" / "ckpt")
    with pytest.raises(ValueError, match="is not a directory"):
        MtpWeights.from_pretrained(checkpoint / "config.json")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(ValueError, match="is a broken symbolic link"):
        MtpWeights.from_pretrained(tmp_path / "dangling")
    with pytest.raises(ValueError, match="directory must be a path"):
        MtpWeights.from_pretrained(7)
    os.symlink(checkpoint, tmp_path / "linked")  # a link to a checkpoint folder (a Hugging Face cache) loads
    assert MtpWeights.from_pretrained(tmp_path / "linked").config == MtpWeights.from_pretrained(checkpoint).config


@pytest.mark.parametrize("args, match", [
    ((0, 0), "shard: world must be >= 1"),
    ((1, 1), r"shard: rank must be in \[0, world=1\)"),
    ((-1, 2), "shard: rank must be >= 0"),
    ((0.0, 2), "shard: rank must be an integer"),
    ((0, 3), "shard: world=3 must divide"),
])
def test_shard_validates_every_argument_naming_it(bf16, args, match):
    kwargs = {"row_parallel_o_proj": False} if args[1] == 3 else {}
    with pytest.raises(ValueError, match=match):
        bf16.shard(*args, **kwargs)
    with pytest.raises(ValueError, match="shard: row_parallel_o_proj must be a bool"):
        bf16.shard(0, 2, row_parallel_o_proj=None)
