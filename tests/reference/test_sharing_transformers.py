"""Index sharing (DESIGN.md §9) against an implementation no one here wrote: transformers' DSA
attention of both families (``GlmMoeDsaAttention`` for GLM-5, ``Glm5NextTextAttention`` for
GLM-5.3-Flash), whose ``"shared"`` layers take ``prev_topk_indices`` instead of running an indexer.

The MTP block is assembled from transformers' modules as in ``test_next_transformers`` (embed with
row 0 zeroed, enorm/hnorm, ``eh_proj`` embedding first, pre-norm attention and MoE residuals, the
post-norm ``x``), with two attentions of the same weights: a ``"full"`` one (layer 0, runs the
indexer) and a ``"shared"`` one (layer 1, no indexer). Each step runs every row so far, uncached:

- draft step 1 writes row p through the full attention; its selection S is row p's top-k indices;
- draft step i >= 2 writes row q = p + i - 1 through the shared attention, with row q's
  ``prev_topk_indices`` set to S (the other rows' to their own selection; their outputs are not read).

Rows pair ``t_{r+1}`` with ``h_r``; a draft row pairs the previous draft with the previous step's
``x``, and rows kept by ``after_verify`` stay in the context with those inputs. The drafter loads the
same weights from a checkpoint in the family's layout and must draft the same tokens with a post-norm
``x`` within 1e-4 relative (float32) at every step, for contexts below and above ``index_topk``,
across KPool pool boundaries inside a propose, and over two proposes with drafts accepted between.
transformers' ``topk`` is patched to break ties to the lower index, as DESIGN pins.
"""

import json

import pytest
import torch
from torch import nn

tfn = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
tfd = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig  # noqa: E402
from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig  # noqa: E402

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer  # noqa: E402
from glm_mtp.reference.checkpoint import save_checkpoint  # noqa: E402

from .test_next_transformers import (  # noqa: E402
    checkpoint_tensors, randomise, text_config as next_text_config, topk_lower_index,
)

FAMILIES = ["glm5", "glm5_next"]
WORST: dict[str, float] = {}


def glm5_text_config() -> GlmMoeDsaConfig:
    c = MtpConfig.preset("tiny")
    t = GlmMoeDsaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts, n_routed_experts=c.n_routed_experts,
        routed_scaling_factor=c.routed_scaling_factor, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_head_dim,
        n_group=c.n_group, topk_group=c.topk_group, num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        first_k_dense_replace=c.first_k_dense_replace,
        pad_token_id=None, indexer_types=["full", "shared"],
    )
    t._attn_implementation = "eager"
    return t


class SharedMtpBlock(nn.Module):
    """The MTP layer from transformers' modules, with a full and a shared attention of one set of
    weights (``tie`` copies them after randomising)."""

    def __init__(self, family: str, t):  # type: ignore[no-untyped-def]
        super().__init__()
        self.next = family == "glm5_next"
        m = tfn if self.next else tfd
        Norm = m.Glm5NextTextRMSNorm if self.next else m.GlmMoeDsaRMSNorm
        Attention = m.Glm5NextTextAttention if self.next else m.GlmMoeDsaAttention
        MoE = m.Glm5NextTextMoE if self.next else m.GlmMoeDsaMoE
        H, eps = t.hidden_size, t.rms_norm_eps
        self.embed_tokens = nn.Embedding(t.vocab_size, H)
        self.lm_head = nn.Linear(H, t.vocab_size, bias=False)
        self.enorm, self.hnorm = Norm(H, eps), Norm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = Norm(H, eps)
        self.self_attn = Attention(t, layer_idx=0)  # "full": runs the indexer, returns its top-k indices
        self.post_attention_layernorm = Norm(H, eps)
        self.mlp = MoE(t)
        self.shared_head_norm = Norm(H, eps)
        self.shared_attn = Attention(t, layer_idx=1)  # "shared": attends prev_topk_indices
        self.rotary = None if self.next else m.GlmMoeDsaRotaryEmbedding(t)
        assert self.shared_attn.indexer is None and self.self_attn.indexer is not None

    def tie(self, t) -> None:  # type: ignore[no-untyped-def]
        """After ``randomise``: the shared attention takes the full one's weights, and the RoPE
        table (a buffer, randomised with the rest) is built again."""
        state = {k: v for k, v in self.self_attn.state_dict().items() if not k.startswith("indexer.")}
        self.shared_attn.load_state_dict(state, strict=True)
        if not self.next:
            self.rotary = tfd.GlmMoeDsaRotaryEmbedding(t)

    def _attend(self, attn: nn.Module, a: torch.Tensor, prev: torch.Tensor | None):  # type: ignore[no-untyped-def]
        L = a.shape[1]
        if self.next:
            out = attn(a, attention_mask=torch.ones(1, L, dtype=torch.bool), prev_topk_indices=prev)
        else:
            pos = torch.arange(L)[None]
            causal = torch.full((L, L), torch.finfo(a.dtype).min).triu(1)[None, None]
            out = attn(a, position_embeddings=self.rotary(a, pos), attention_mask=causal, position_ids=pos,
                       prev_topk_indices=prev)
        return out[0], out[2]

    def forward(self, tokens: torch.Tensor, hiddens: torch.Tensor, shared: list[int] | None = None):  # type: ignore[no-untyped-def]
        """Rows pairing ``tokens`` (L,) with ``hiddens`` (L, H). Returns the newest row's post-norm
        ``x`` (H,) and the rows it attended: its own selection, or ``shared`` (attended through the
        shared attention) when given."""
        e = self.embed_tokens(tokens)[None]
        e[:, 0] = 0.0  # row 0's token has no predecessor
        u = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(hiddens[None])), dim=-1))
        a = self.input_layernorm(u)
        attended, topk = self._attend(self.self_attn, a, None)
        own = sorted(set(topk[0, -1].tolist()) - {-1})
        if shared is not None:
            prev = topk.clone()
            prev[0, -1] = torch.tensor((shared + [shared[0]] * prev.shape[-1])[: prev.shape[-1]])  # padded by repeats
            attended, _ = self._attend(self.shared_attn, a, prev)
        u = u + attended
        out = u + self.mlp(self.post_attention_layernorm(u))
        return self.shared_head_norm(out)[0, -1], (own if shared is None else shared)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    if family == "glm5_next":
        t = next_text_config()
        t.indexer_types = ["full", "shared"]
        config = Glm5NextConfig(text_config=t.to_dict()).to_dict()
        preset = MtpConfig.preset("glm5next_tiny")
    else:
        t = glm5_text_config()
        t.index_share_for_mtp_iteration = True
        config = t.to_dict()
        preset = MtpConfig.preset("tiny").replace(index_share_for_mtp_iteration=True)
    block = SharedMtpBlock(family, t).float().eval()
    randomise(block, torch.Generator().manual_seed(13))
    block.tie(t)
    directory = tmp_path_factory.mktemp(family) / "ck"
    root = "model.language_model." if family == "glm5_next" else "model."
    save_checkpoint(directory, json.loads(json.dumps(config, default=str)),
                    checkpoint_tensors(block, t.num_hidden_layers, root), 40)
    weights = MtpWeights.from_pretrained(directory)
    assert weights.config == preset and weights.dtype == torch.float32
    return family, block, weights


def transformers_propose(block: SharedMtpBlock, rows: list[tuple[int, torch.Tensor]], token: int, hidden: torch.Tensor,
                         k: int):
    """A propose of k drafts after the context ``rows`` ((token, hidden) per row) on transformers'
    modules: step 1 through the full attention, steps 2..k through the shared one over step 1's
    rows. Returns the drafts, each step's ``x`` and each draft row's (token, hidden)."""
    drafts, xs, written, S = [], [], [], None
    for _ in range(k):
        written.append((token, hidden))
        seq = rows + written
        x, attended = block(torch.tensor([r[0] for r in seq]), torch.stack([r[1] for r in seq]), S)
        S = attended
        token, hidden = int(block.lm_head(x).argmax()), x
        drafts.append(token)
        xs.append(x.double())
    return drafts, xs, written


# (context rows, k, drafts accepted, k of the second propose)
CASES = {
    "below_topk": (2, 3, 1, 3),  # rows 0..4 then 0..6: every row visible (index_topk 6 / 8)
    "across_topk": (5, 4, 2, 4),  # crosses index_topk inside the proposes
    "above_topk_pools": (13, 4, 3, 3),  # 14+: more rows than index_topk; KPool pools complete inside both proposes
}


@pytest.mark.parametrize("case", list(CASES))
def test_shared_drafts_match_transformers(setup, case, monkeypatch):
    family, block, weights = setup
    context, k1, accepted, k2 = CASES[case]
    g = torch.Generator().manual_seed(len(case) * 7 + context)
    H, V = weights.config.hidden_size, weights.config.vocab_size
    tokens = torch.randint(V, (context + 2,), generator=g)  # t_0 .. t_{context+1}
    hiddens = torch.randn(context + 1, H, generator=g)  # h_0 .. h_context
    rows = [(int(tokens[r + 1]), hiddens[r]) for r in range(context)]  # row r: (t_{r+1}, h_r)

    prop = ReferenceProposer(weights, max_seq_len=64)
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(tokens[: context + 1], hiddens, state)  # rows [0, context)
    token, hidden, position = int(tokens[context + 1]), hiddens[context], context
    worst = 0.0
    for k, keep in ((k1, accepted), (k2, None)):
        monkeypatch.setattr(torch, "topk", topk_lower_index)
        monkeypatch.setattr(torch.Tensor, "topk",
                            lambda self, k, dim=-1, largest=True, sorted=True: topk_lower_index(self, k, dim, largest))
        with torch.no_grad():
            want, want_x, written = transformers_propose(block, rows, token, hidden, k)
        monkeypatch.undo()
        for i in range(1, k + 1):  # each step's x: a propose of i drafts (the first i steps of this one)
            got = prop.propose(token, hidden, position, i, state)
            x = prop.export_state(state)["x"].double()
            err = float((x - want_x[i - 1]).abs().max() / want_x[i - 1].abs().max())
            worst = max(worst, err)
            assert got == want[:i], (family, case, i)
            assert err <= 1e-4, (family, case, i, err)
            prop.after_verify(0 if i < k or keep is None else keep, state)
        if keep is None:
            break
        rows = rows + written[: keep + 1]  # the first row and the accepted drafts' rows stay
        position += keep + 1
        # the bonus, the target's hidden
        token, hidden = int(torch.randint(V, (1,), generator=g)), torch.randn(H, generator=g)
    WORST[family] = max(WORST.get(family, 0.0), worst)
    print(f"{family} {case}: sharing vs transformers' shared DSA layers, max rel err of x = {worst:.3e}")


def test_flag_off_differs_from_the_shared_layers(setup, monkeypatch):
    """The comparison can fail: the same weights with sharing off draft a different ``x`` at step
    2 than transformers' shared step (step 2 then attends its own row)."""
    family, block, weights = setup
    g = torch.Generator().manual_seed(5)
    H, V = weights.config.hidden_size, weights.config.vocab_size
    tokens, hiddens = torch.randint(V, (15,), generator=g), torch.randn(14, H, generator=g)
    rows = [(int(tokens[r + 1]), hiddens[r]) for r in range(13)]
    monkeypatch.setattr(torch, "topk", topk_lower_index)
    monkeypatch.setattr(torch.Tensor, "topk",
                        lambda self, k, dim=-1, largest=True, sorted=True: topk_lower_index(self, k, dim, largest))
    with torch.no_grad():
        _, want_x, _ = transformers_propose(block, rows, int(tokens[14]), hiddens[13], 2)
    monkeypatch.undo()
    prop = ReferenceProposer(weights.with_index_share(False), max_seq_len=64)
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(tokens[:14], hiddens, state)
    prop.propose(int(tokens[14]), hiddens[13], 13, 2, state)
    x = prop.export_state(state)["x"].double()
    assert float((x - want_x[1]).abs().max() / want_x[1].abs().max()) > 1e-3
