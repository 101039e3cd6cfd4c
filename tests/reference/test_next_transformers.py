"""Agreement with an implementation no one here wrote: transformers' ``Glm5NextTextAttention``
and ``Glm5NextTextMoE`` (+ ``Glm5NextTextRMSNorm``) assembled as GLM-5.3-Flash's MTP block
(DESIGN.md §7: the plain pre-norm residual block, embedding first in ``eh_proj``, post-norm
output), random weights (the KPool gate and position tables too, which transformers initialises
to constants), written as a checkpoint in the real layout, loaded by ``MtpWeights.from_pretrained``.

After a prefill of L rows, the newest row's post-norm output ``x`` and its draft must agree, in
float32: relative error <= 1e-4, drafts equal. transformers' ``topk`` breaks ties arbitrarily;
it is patched to the lower index, as DESIGN pins (scores tie exactly at 0 when every index head's
relu is 0). Lengths (kpool 4, index_topk 8: two pools selected):

- L 3: the newest row has a tail only (no complete pool);
- L 6: fewer complete pools (1) than index_topk / kpool;
- L 16: the newest row completes its pool (empty tail), 4 candidates;
- L 23 and 30: more complete pools (5, 7) than are selected.
"""

import json

import pytest
import torch
from torch import nn

tf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig, Glm5NextTextConfig  # noqa: E402

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer  # noqa: E402
from glm_mtp.reference.checkpoint import save_checkpoint  # noqa: E402

CFG = MtpConfig.preset("glm5next_tiny")
LENGTHS = [3, 6, 16, 23, 30]
ERRORS: dict[int, float] = {}


def text_config() -> Glm5NextTextConfig:
    c = CFG
    t = Glm5NextTextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts, n_routed_experts=c.n_routed_experts,
        routed_scaling_factor=c.routed_scaling_factor, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=0, v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_head_dim, n_group=c.n_group,
        topk_group=c.topk_group, num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads,
        swiglu_limit=c.swiglu_limit, index_kpool=c.index_kpool, index_kpool_always_select_tail=True,
        pad_token_id=None,
        mlp_layer_types=(["dense"] * c.first_k_dense_replace
                         + ["sparse"] * (c.num_hidden_layers - c.first_k_dense_replace)),
    )
    t.index_share_for_mtp_iteration = True  # as the release's config.json (and the preset): DESIGN.md §9
    t._attn_implementation = "eager"
    return t


class MtpBlock(nn.Module):
    """§7's MTP layer from transformers' modules: embed (row 0 zeroed) -> enorm, hnorm ->
    eh_proj(cat[e, h]) -> input_layernorm -> attention -> residual -> post_attention_layernorm ->
    MoE -> residual -> shared_head.norm -> lm_head."""

    def __init__(self, t: Glm5NextTextConfig):
        super().__init__()
        H, eps = t.hidden_size, t.rms_norm_eps
        self.embed_tokens = nn.Embedding(t.vocab_size, H)
        self.lm_head = nn.Linear(H, t.vocab_size, bias=False)
        self.enorm, self.hnorm = tf.Glm5NextTextRMSNorm(H, eps), tf.Glm5NextTextRMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = tf.Glm5NextTextRMSNorm(H, eps)
        self.self_attn = tf.Glm5NextTextAttention(t, layer_idx=0)  # index 0: a "full" indexer layer
        self.post_attention_layernorm = tf.Glm5NextTextRMSNorm(H, eps)
        self.mlp = tf.Glm5NextTextMoE(t)
        self.shared_head_norm = tf.Glm5NextTextRMSNorm(H, eps)

    def forward(self, tokens: torch.Tensor, hiddens: torch.Tensor) -> torch.Tensor:
        """Rows pairing ``tokens`` (L,) with ``hiddens`` (L, H): the post-norm outputs (L, H)."""
        e = self.embed_tokens(tokens)[None]
        e[:, 0] = 0.0  # row 0's token has no predecessor
        u = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(hiddens[None])), dim=-1))
        mask = torch.ones(1, tokens.shape[0], dtype=torch.bool)  # the indexer's padding mask: none
        u = u + self.self_attn(self.input_layernorm(u), attention_mask=mask)[0]
        out = u + self.mlp(self.post_attention_layernorm(u))
        return self.shared_head_norm(out)[0]


def randomise(block: nn.Module, gen: torch.Generator) -> None:
    """Every parameter and buffer random (transformers leaves experts uninitialised and the
    router, its bias and the KPool gate/position tables at constants)."""
    with torch.no_grad():
        for name, p in [*block.named_parameters(), *block.named_buffers()]:
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                p.copy_(r * 0.1)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("index_kpool_compress_ape") or name.startswith("embed_tokens"):
                p.copy_(r)
            else:
                p.copy_(r * p.shape[-1] ** -0.5)


def checkpoint_tensors(block: nn.Module, layer: int, root: str = "model.language_model.") -> dict[str, torch.Tensor]:
    """The block's tensors under the checkpoint names (per-expert tensors): GLM-5.3-Flash's
    ``root`` by default, GLM-5's ``model.``."""
    p = f"{root}layers.{layer}."
    out = {root + "embed_tokens.weight": block.embed_tokens.weight, "lm_head.weight": block.lm_head.weight,
           p + "enorm.weight": block.enorm.weight, p + "hnorm.weight": block.hnorm.weight,
           p + "eh_proj.weight": block.eh_proj.weight, p + "shared_head.norm.weight": block.shared_head_norm.weight,
           p + "input_layernorm.weight": block.input_layernorm.weight,
           p + "post_attention_layernorm.weight": block.post_attention_layernorm.weight}
    out.update({p + "self_attn." + n: t for n, t in block.self_attn.state_dict().items()})
    moe = block.mlp
    out[p + "mlp.gate.weight"] = moe.gate.weight
    out[p + "mlp.gate.e_score_correction_bias"] = moe.gate.e_score_correction_bias
    I = moe.experts.intermediate_dim
    for e in range(moe.experts.num_experts):
        out[p + f"mlp.experts.{e}.gate_proj.weight"] = moe.experts.gate_up_proj[e, :I]
        out[p + f"mlp.experts.{e}.up_proj.weight"] = moe.experts.gate_up_proj[e, I:]
        out[p + f"mlp.experts.{e}.down_proj.weight"] = moe.experts.down_proj[e]
    out.update({p + "mlp.shared_experts." + n: t for n, t in moe.shared_experts.state_dict().items()})
    return {n: t.detach().clone().contiguous() for n, t in out.items()}


def topk_lower_index(x, k, dim=-1, largest=True, sorted=True, *, out=None):
    """``torch.topk`` with ties to the lower index (a stable sort), as DESIGN pins."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    t = text_config()
    block = MtpBlock(t).float().eval()
    randomise(block, torch.Generator().manual_seed(11))
    directory = tmp_path_factory.mktemp("glm5next") / "ck"
    config = Glm5NextConfig(text_config=t.to_dict()).to_dict()
    save_checkpoint(directory, json.loads(json.dumps(config, default=str)),
                    checkpoint_tensors(block, t.num_hidden_layers), 40)
    weights = MtpWeights.from_pretrained(directory)
    assert weights.config == CFG and weights.dtype == torch.float32
    return block, weights


def test_the_checkpoint_is_read_as_the_preset(setup):
    _, weights = setup
    ix = weights.layer.attn.indexer
    assert not (ix.kpool_ape == 0).all() and not (ix.kpool_gate == 1).all()  # randomised, not the init constants


@pytest.mark.parametrize("L", LENGTHS)
def test_newest_row_matches_transformers(setup, L, monkeypatch):
    block, weights = setup
    g = torch.Generator().manual_seed(100 + L)
    tokens = torch.randint(CFG.vocab_size, (L + 1,), generator=g)  # t_0 .. t_L
    hiddens = torch.randn(L, CFG.hidden_size, generator=g)  # h_0 .. h_{L-1}

    monkeypatch.setattr(torch, "topk", topk_lower_index)
    monkeypatch.setattr(torch.Tensor, "topk",
                        lambda self, k, dim=-1, largest=True, sorted=True: topk_lower_index(self, k, dim, largest))
    with torch.no_grad():
        want_x = block(tokens[1:], hiddens)[-1].double()  # rows r pair t_{r+1} with h_r
        want_draft = int(block.lm_head(want_x.float()).argmax())
    monkeypatch.undo()

    prop = ReferenceProposer(weights, max_seq_len=64)
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(tokens[:L], torch.cat((hiddens[: L - 1], hiddens[-1:])), state)  # rows [0, L-1)
    draft = prop.propose(int(tokens[L]), hiddens[L - 1], L - 1, 1, state)  # row L-1
    got_x = prop.export_state(state)["x"].double()
    err = float((got_x - want_x).abs().max() / want_x.abs().max())
    ERRORS[L] = err
    print(f"glm5next vs transformers, L={L}: max rel err of x = {err:.3e}, draft {draft[0]} vs {want_draft}")
    assert err <= 1e-4
    assert draft == [want_draft]
