"""An independent float64 implementation of GLM-5.3-Flash's MTP block (DESIGN.md §7), written
from the spec's prose and nothing of ``glm_mtp``'s forward: whole sequence at once, expanded keys
and values (no latent absorption), plain torch float64 (matmul, softmax, sum: this is a test-tree
oracle, not the pinned drafter), one loop over rows for the KPool selection.

It makes the golden vectors under ``tests/data/golden/glm5next_*`` (README there):

    PYTHONPATH=src python tests/reference/next_golden_model.py

which writes, per case, a checkpoint in GLM-5.3-Flash's layout (random float32 weights) and
``expected.safetensors`` with this model's outputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
# name, index_topk, rows, seed: with index_kpool 4
NEXT_CASES = [("glm5next_topk8_n30", 8, 30, 200), ("glm5next_topk16_n13", 16, 13, 201)]


def rms_norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def clamped_swiglu(x, gate, up, down, limit):
    g = (x @ gate.T).clamp(max=limit)
    u = (x @ up.T).clamp(min=-limit, max=limit)
    return (F.silu(g) * u) @ down.T


def read_checkpoint(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The text config and every tensor of a one-file checkpoint, in float64."""
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config") or config
    tensors = {k: v.double() for k, v in load_file(directory / "model.safetensors").items()}
    return text, tensors


def forward(
    text: dict, t: dict[str, torch.Tensor], tokens: torch.Tensor, hiddens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Rows r = 0..n-1 pairing ``tokens[r + 1]`` with ``hiddens[r]``: every row's block input,
    layer output, post-norm ``x``, logits, draft, and the pooled keys of the complete pools."""
    L = text["num_hidden_layers"]
    P = f"model.language_model.layers.{L}."
    w = lambda name: t[P + name]  # noqa: E731
    eps, n = text["rms_norm_eps"], hiddens.shape[0]
    nh, nope, vdim = text["num_attention_heads"], text["qk_nope_head_dim"], text["v_head_dim"]
    Hi, D, kp, topk = text["index_n_heads"], text["index_head_dim"], text["index_kpool"], text["index_topk"]
    limit = text["swiglu_limit"]

    e = t["model.language_model.embed_tokens.weight"][tokens[1:]].clone()
    e[0] = 0.0
    u = (
        torch.cat((rms_norm(e, w("enorm.weight"), eps), rms_norm(hiddens, w("hnorm.weight"), eps)), -1)
        @ w("eh_proj.weight").T
    )
    a = rms_norm(u, w("input_layernorm.weight"), eps)

    # MLA without RoPE: expanded per-head keys and values from the normed latent.
    q_lat = rms_norm(a @ w("self_attn.q_a_proj.weight").T, w("self_attn.q_a_layernorm.weight"), eps)
    q = (q_lat @ w("self_attn.q_b_proj.weight").T).view(n, nh, nope)
    c = rms_norm(a @ w("self_attn.kv_a_proj_with_mqa.weight").T, w("self_attn.kv_a_layernorm.weight"), eps)
    kv = (c @ w("self_attn.kv_b_proj.weight").T).view(n, nh, nope + vdim)
    k_heads, v_heads = kv[..., :nope], kv[..., nope:]

    # The KPool indexer.
    ix = "self_attn.indexer."
    qi = (q_lat @ w(ix + "wq_b.weight").T).view(n, Hi, D)
    k = layer_norm(a @ w(ix + "wk.weight").T, w(ix + "k_norm.weight"), w(ix + "k_norm.bias"), 1e-6)
    gate = a @ w(ix + "index_kpool_compress_gate").T
    ape = w(ix + "index_kpool_compress_ape")
    head_w = (a @ w(ix + "weights_proj.weight").T) * Hi**-0.5
    pools = n // kp
    pool_keys = torch.stack([(torch.softmax(gate[p * kp : p * kp + kp] + ape, dim=0) * k[p * kp : p * kp + kp]).sum(0)
                             for p in range(pools)]) if pools else torch.zeros(0, D, dtype=torch.float64)

    attn_out = torch.zeros(n, nh * vdim, dtype=torch.float64)
    for r in range(n):
        candidates = list(range((r + 1) // kp))
        score = {p: float((head_w[r] * torch.relu(qi[r] @ pool_keys[p] * D**-0.5)).sum()) for p in candidates}
        chosen = sorted(sorted(candidates, key=lambda p: (-score[p], p))[: topk // kp])
        rows = [s for p in chosen for s in range(p * kp, p * kp + kp)] + list(range(kp * ((r + 1) // kp), r + 1))
        s = torch.einsum("hd,shd->hs", q[r], k_heads[rows]) * nope**-0.5
        attn_out[r] = torch.einsum("hs,shv->hv", torch.softmax(s, -1), v_heads[rows]).reshape(-1)
    h1 = u + attn_out @ w("self_attn.o_proj.weight").T

    # MoE: sigmoid router, selection by the biased score (ties to the lower id), normalised weights.
    m = rms_norm(h1, w("post_attention_layernorm.weight"), eps)
    scores = torch.sigmoid(m @ w("mlp.gate.weight").T)
    biased = scores + w("mlp.gate.e_score_correction_bias")
    moe = torch.zeros_like(m)
    for r in range(n):
        ids = sorted(
            sorted(range(scores.shape[1]), key=lambda i: (-float(biased[r, i]), i))[: text["num_experts_per_tok"]]
        )
        weights = scores[r, ids]
        weights = weights / (weights.sum() + 1e-20) * text["routed_scaling_factor"]
        for wj, i in zip(weights, ids):
            E = f"mlp.experts.{i}."
            moe[r] += wj * clamped_swiglu(m[r], w(E + "gate_proj.weight"), w(E + "up_proj.weight"),
                                          w(E + "down_proj.weight"), limit)
    S = "mlp.shared_experts."
    moe += clamped_swiglu(m, w(S + "gate_proj.weight"), w(S + "up_proj.weight"), w(S + "down_proj.weight"), limit)
    out = h1 + moe
    x = rms_norm(out, w("shared_head.norm.weight"), eps)
    logits = x @ t["lm_head.weight"].T
    return {"eh_proj_out": u, "pre_norm_out": out, "x": x, "logits": logits, "drafts": logits.argmax(-1),
            "pool_keys": pool_keys}


def make_cases() -> None:
    """Write the checkpoints and expected outputs of ``NEXT_CASES``."""
    from glm_mtp.reference import MtpConfig, MtpWeights

    for name, topk, n, seed in NEXT_CASES:
        cfg = MtpConfig.preset("glm5next_tiny").replace(index_topk=topk)
        directory = GOLDEN / name
        MtpWeights.random(cfg, seed=seed, dtype=torch.float32).save_pretrained(directory)
        g = torch.Generator().manual_seed(seed + 1000)
        tokens = torch.randint(cfg.vocab_size, (n + 1,), generator=g)
        hiddens = torch.randn(n, cfg.hidden_size, generator=g)
        text, tensors = read_checkpoint(directory)
        out = forward(text, tensors, tokens, hiddens.double())
        top2 = out["logits"].topk(2, -1).values
        print(f"{name}: smallest top-2 logit gap {float((top2[:, 0] - top2[:, 1]).min()):.4f}")
        save_file({"tokens": tokens, "hiddens": hiddens, **{k: v.contiguous() for k, v in out.items()}},
                  directory / "expected.safetensors")


if __name__ == "__main__":
    sys.exit(make_cases())
