"""A small target model of the GLM-5 architecture, built from the drafter's own layer code.

    h      = embed_tokens[tokens]
    h      = decoder_layer_i(h)      i < first_k_dense_replace: dense SwiGLU MLP, else MoE
    hidden = norm(h)                 the final-normed hidden: what lm_head and the drafter read
    logits = lm_head(hidden)

Every layer is ``glm_mtp.reference.block.decoder_layer`` with the reference weights, caches
(``LayerCache``) and RoPE table, so the target and the drafter share one implementation. The
target computes with torch's kernels (``numerics.VENDOR``, the default and what training uses) or,
with ``numerics="pinned"``, in the drafter's pinned order (``numerics.PINNED``, DESIGN.md §5):
then every row is computed exactly as if alone, so a (k+1)-token verification gives the bytes of
k+1 one-token decodes and greedy speculative decoding equals greedy decoding in bf16 too. Rows are
the target's positions: position p lives in slot p and rotates at p. Rolling back is lowering
``length``: a row past it is overwritten before any query can see it.

Training uses the same function with ``moe=grouped_moe``: the reference MoE runs each row's
experts on that row alone (exact, batch-independent, slow); ``grouped_moe`` routes identically
(``reference.moe.route``) and runs each expert once on all the rows it received.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_mtp.reference.attention import KPoolRowsFn, Rope
from glm_mtp.reference.block import MoeFn, decoder_layer
from glm_mtp.reference.checkpoint import checkpoint_weight_map, read_tensors
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.kpool import kpool_rows
from glm_mtp.reference.numerics import PINNED, VENDOR, Numerics, acc_dtype
from glm_mtp.reference.moe import expert_swiglu, moe_block, route
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache, num_blocks
from glm_mtp.reference.weights import (
    DecoderLayerWeights,
    MoeWeights,
    decoder_layer_from_tensors,
    decoder_layer_to_tensors,
    layer_tensor_shapes,
    random_tensor,
)


def model_prefix(cfg: MtpConfig) -> str:
    """Where the target's decoder lives in a checkpoint: ``model.`` (GLM-5) or
    ``model.language_model.`` (GLM-5.3-Flash's text model, glm5_next); the MTP layer sits after
    its layers and the embedding is ``cfg.embed_tokens_name`` in both."""
    return "model.language_model." if cfg.is_next else "model."


def is_dense(cfg: MtpConfig, i: int) -> bool:
    """Layer ``i`` of the target has a dense MLP (GLM-5's first ``first_k_dense_replace`` layers)."""
    return i < cfg.first_k_dense_replace


@dataclass
class TargetWeights:
    """The target's tensors.

    Args:
        config: shapes; ``num_hidden_layers`` decoder layers, the first ``first_k_dense_replace`` dense.
        embed_tokens: ``model.embed_tokens.weight`` (V, H), shared with the drafter.
        layers: the decoder layers, ``model.layers.{i}.*``.
        norm: ``model.norm.weight`` (H,), the final RMSNorm.
        (glm5_next: the same names under ``model.language_model.``, ``model_prefix``.)
        lm_head: ``lm_head.weight`` (V, H), shared with the drafter's ``shared_head``.
    """

    config: MtpConfig
    embed_tokens: Tensor
    layers: list[DecoderLayerWeights]
    norm: Tensor
    lm_head: Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @classmethod
    def random(cls, cfg: MtpConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> TargetWeights:
        """Random weights of a sensible scale (``reference.weights.random_tensor``), by seed."""
        gen = torch.Generator().manual_seed(seed)
        t = {n: random_tensor(n, s, gen) for n, s in target_tensor_shapes(cfg).items()}
        return cls.from_tensors(cfg, t, dtype, device)

    @classmethod
    def from_tensors(cls, cfg: MtpConfig, t: dict[str, Tensor], dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu") -> TargetWeights:
        """From tensors keyed by absolute checkpoint names (the routing bias stays float32)."""

        def place(n: str, x: Tensor) -> Tensor:
            if n.endswith("e_score_correction_bias"):
                return x.to(device=device, dtype=torch.float32)
            return x.to(device=device, dtype=dtype or x.dtype)

        layers = []
        for i in range(cfg.num_hidden_layers):
            prefix = f"{model_prefix(cfg)}layers.{i}."
            rel = {n[len(prefix):]: place(n, x) for n, x in t.items() if n.startswith(prefix)}
            layers.append(decoder_layer_from_tensors(cfg, rel, sparse=not is_dense(cfg, i)))
        return cls(
            config=cfg,
            embed_tokens=place("e", t[cfg.embed_tokens_name]),
            layers=layers,
            norm=place("n", t[f"{model_prefix(cfg)}norm.weight"]),
            lm_head=place("h", t["lm_head.weight"]),
        )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], dtype: torch.dtype | None = None,
                        device: torch.device | str = "cpu") -> TargetWeights:
        """The target's layers ``model.layers.{0..L-1}``, norm, embedding and head from a GLM-5
        style checkpoint directory (the MTP layer ``model.layers.{L}`` is not read)."""
        cfg = MtpConfig.from_hf_config(directory)
        wmap = checkpoint_weight_map(directory)
        shapes = target_tensor_shapes(cfg)
        missing = [n for n in shapes if n not in wmap]
        if missing:
            raise ValueError(f"{os.fspath(directory)}: missing target tensor {missing[0]!r} ({len(missing)} missing)")
        t = read_tensors(directory, list(shapes), wmap)
        for n, s in shapes.items():
            if tuple(t[n].shape) != s:
                raise ValueError(f"tensor {n!r} has shape {tuple(t[n].shape)}, expected {s}")
        return cls.from_tensors(cfg, t, dtype, device)

    def state_dict(self) -> dict[str, Tensor]:
        """Absolute GLM-5 checkpoint names -> tensors (experts unstacked, as checkpoints hold them)."""
        stem = model_prefix(self.config)
        out = {self.config.embed_tokens_name: self.embed_tokens, f"{stem}norm.weight": self.norm,
               "lm_head.weight": self.lm_head}
        for i, layer in enumerate(self.layers):
            out.update({f"{stem}layers.{i}.{n}": x for n, x in decoder_layer_to_tensors(layer).items()})
        return out


def target_tensor_shapes(cfg: MtpConfig) -> dict[str, tuple[int, ...]]:
    """Absolute checkpoint name -> shape for every tensor of the target (not the MTP layer)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    stem = model_prefix(cfg)
    out: dict[str, tuple[int, ...]] = {cfg.embed_tokens_name: (V, H)}
    for i in range(cfg.num_hidden_layers):
        out.update(
            {f"{stem}layers.{i}.{n}": s for n, s in layer_tensor_shapes(cfg, sparse=not is_dense(cfg, i)).items()}
        )
    out[f"{stem}norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    return out


# ------------------------------------------------------------------------------------------------


@dataclass
class TargetState:
    """One sequence's target caches: ``length`` positions held, one ``LayerCache`` per layer."""

    caches: list[LayerCache]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.caches[0].capacity


@dataclass
class TargetOutput:
    """Per new position: ``logits`` (T, V) in acc dtype, ``hidden`` (T, H) the final-normed hidden;
    ``sample`` (T,) int64 the target's seeded samples (DESIGN.md §14) where the target answers them
    itself (a replay of a sampled trace; -1 in rows it does not answer), None where the loop draws
    them from the logits."""

    logits: Tensor
    hidden: Tensor
    sample: Tensor | None = None


TARGET_NUMERICS = {"vendor": VENDOR, "pinned": PINNED}


def target_numerics(numerics: str | Numerics) -> Numerics:
    """``vendor`` -> ``numerics.VENDOR``, ``pinned`` -> ``numerics.PINNED`` (a ``Numerics`` as is)."""
    if isinstance(numerics, Numerics):
        return numerics
    if numerics not in TARGET_NUMERICS:
        raise ValueError(f"target numerics must be one of {tuple(TARGET_NUMERICS)}, got {numerics!r}")
    return TARGET_NUMERICS[numerics]


def class_path(obj: object) -> str:
    """The dotted path of ``obj``'s class (``glm_mtp.experiments.targets.target.Target``): what a
    trace's and a summary's ``target.implementation`` records, read from the class itself so that
    a module's move cannot leave a stale name in the data."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class Target:
    """The target model for inference: prefill, verify, roll back.

    Args:
        weights: the target's tensors.
        max_seq_len: the longest sequence a state serves; a state holds
            ``16 * (max_seq_len // 16 + 2)`` positions, like the drafter's pool.
        moe: the MoE computation (the reference ``moe_block`` by default).
        numerics: ``vendor`` (torch's kernels; the default) or ``pinned`` (the pinned order of
            DESIGN.md §5: batch-invariant, slower), by name or as a ``Numerics``.
        kpool: the KPool indexer of glm5_next layers (``attention.KPoolRowsFn``; default
            ``kpool.kpool_rows``); training passes one that also scores the indexer's loss.
    """

    def __init__(self, weights: TargetWeights, max_seq_len: int, moe: MoeFn = moe_block,
                 numerics: str | Numerics = "vendor",
                 kpool: KPoolRowsFn = kpool_rows) -> None:
        self.ops = target_numerics(numerics)
        self.weights = weights
        self.config = weights.config
        self.blocks = num_blocks(max_seq_len)
        self.capacity = BLOCK_ROWS * self.blocks
        self.rope = Rope.build(self.config, self.capacity, weights.device)
        self.moe = moe
        self.kpool = kpool

    def alloc_state(self) -> TargetState:
        """Fresh caches (zeros), ``length = 0``."""
        w = self.weights
        return TargetState([LayerCache.allocate(self.config, self.blocks, w.dtype, w.device) for _ in w.layers])

    def forward(self, tokens: Tensor, state: TargetState) -> TargetOutput:
        """Run ``tokens`` (T,) at positions ``[length, length + T)``, write their rows, advance ``length``."""
        w, cfg = self.weights, self.config
        T = tokens.shape[0]
        if state.length + T > self.capacity:
            raise ValueError(f"tokens: positions up to {state.length + T} run past the target's capacity of "
                             f"{self.capacity}")
        slots = torch.arange(state.length, state.length + T, device=w.device)
        h = F.embedding(tokens.to(w.device), w.embed_tokens)  # (T, H)
        for layer, cache in zip(w.layers, state.caches):
            h = decoder_layer(layer, cfg, h, slots, cache, self.rope, moe=self.moe, ops=self.ops, kpool=self.kpool)
        hidden = self.ops.rms_norm(h, w.norm, cfg.rms_norm_eps)  # (T, H)
        state.length += T
        return TargetOutput(logits=self.ops.linear(hidden, w.lm_head).to(acc_dtype(hidden.dtype)), hidden=hidden)

    # The loop's target interface (``speculative.TargetModel``): a prefill, verifies, rollbacks.

    def prefill(self, tokens: list[int], state: TargetState) -> TargetOutput:
        """The prompt at positions ``[0, n)`` of an empty state."""
        if state.length:
            raise ValueError(f"prefill needs an empty state; this one holds {state.length} positions (alloc_state a "
                             "new one)")
        return self.forward(torch.tensor(tokens), state)

    def verify(self, tokens: list[int], state: TargetState) -> TargetOutput:
        """``tokens`` at positions ``[length, length + T)``."""
        return self.forward(torch.tensor(tokens), state)

    def rollback(self, state: TargetState, length: int) -> None:
        """Keep positions ``< length`` (``rewind``: any length back to 0 is exact here)."""
        self.rewind(state, length)

    def rewind(self, state: TargetState, length: int) -> None:
        """Forget positions ``>= length`` (nothing is copied: later writes overwrite them; a
        glm5_next layer's KPool pool that loses a row becomes incomplete, as in the drafter)."""
        if not 0 <= length <= state.length:
            raise ValueError(f"length must be in [0, {state.length}], got {length}")
        state.length = length
        for cache in state.caches:
            if cache.kpool is not None:
                cache.kpool.forget_from(length)


# ------------------------------------------------------------------------------------------------
# The training-time MoE dispatch.


@dataclass
class ExpertLoad:
    """Rows routed to each expert since the last reset, keyed by the MoE's router tensor id."""

    counts: dict[int, Tensor] = field(default_factory=dict)

    def add(self, moe: MoeWeights, experts: Tensor) -> None:
        c = torch.bincount(experts.flatten(), minlength=moe.router.shape[0])
        key = id(moe.router)
        self.counts[key] = self.counts.get(key, 0) + c


def grouped_moe(moe: MoeWeights, cfg: MtpConfig, m: Tensor, ops: Numerics = VENDOR,
                load: ExpertLoad | None = None) -> Tensor:
    """The MoE of ``reference.moe.moe_block`` for rows ``m`` (T, H), with each expert run once on
    the rows routed to it (index_select in, weighted index_add out). Same routing and weights;
    the sums may round differently, so it is for training (it is differentiable), not for the
    bit-exact paths. ``load`` collects expert counts for the bias update."""
    acc = acc_dtype(m.dtype)
    experts, weights = route(moe, cfg, m, ops)  # (T, k), (T, k)
    if load is not None:
        load.add(moe, experts.detach())
    T, k = experts.shape
    flat_e = experts.flatten()
    flat_t = torch.arange(T, device=m.device).repeat_interleave(k)
    flat_w = weights.flatten()
    out = torch.zeros(T, m.shape[1], dtype=acc, device=m.device)
    swiglu = expert_swiglu(moe, ops)  # clamped in glm5_next
    for e in range(moe.router.shape[0]):
        sel = (flat_e == e).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        rows = flat_t[sel]
        y = swiglu(m[rows], moe.experts_gate[e], moe.experts_up[e], moe.experts_down[e])  # (n, H)
        out = out.index_add(0, rows, y.to(acc) * flat_w[sel, None])
    if moe.shared is not None:
        out = out + swiglu(m, moe.shared.gate_proj, moe.shared.up_proj, moe.shared.down_proj).to(acc)
    return out.to(m.dtype)
