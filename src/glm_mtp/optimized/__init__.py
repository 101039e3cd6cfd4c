"""The optimized MTP drafter of both families (GLM-5's ``glm_moe_dsa`` and GLM-5.3-Flash's
``glm5_next``: KPool indexer, NoPE MLA, clamped SwiGLU, index sharing across draft steps; bf16 or
block-scaled fp8 weights): static buffers, a CUDA-graph-captured k-draft propose and exact fused
Triton kernels, equal to ``glm_mtp.reference.ReferenceProposer`` bit for bit.

Imports torch, triton, einops and the reference package only (no Hydra, no W&B): production
imports it alone. An engine loop (``t_m`` the newest committed token, ``h`` the target's
final-normed hiddens, DESIGN.md §4)::

    from glm_mtp.optimized import MtpWeights, OptimizedProposer

    w = MtpWeights.from_pretrained(ckpt_dir, dtype=torch.bfloat16, device="cuda")
    drafter = OptimizedProposer(w, max_seq_len=8192)
    state = drafter.alloc_state("cuda")                  # every buffer, once
    drafter.prefill_drafter(prompt, h[:n], state)        # prompt t_0..t_{n-1}: rows [0, n-1)
    m, token = n, first_token                            # t_n, from the target's prefill
    while generating:
        drafts = drafter.propose(token, h[m - 1], m - 1, k, state)   # one host read, at the end
        a, bonus = target_verify([token, *drafts])                    # a drafts accepted
        drafter.after_verify(a, state)                                # counters only
        if a == k:                                                    # one row behind
            drafter.catchup_drafter([drafts[-1]], h[m + k - 1 : m + k], m + k - 1, m + k - 1, state)
        m, token = m + a + 1, bonus
    drafter.free_state(state)                            # buffers and captured graphs

``propose_device`` returns the drafts as a device tensor without any host sync;
``reset_state`` readies a state for a new sequence keeping its captured graphs.
``propose_sampled(token, h, position, k, temperature, noise, state)`` drafts by sampling (draft i
= argmax(q_i / noise[i]), q_i the pinned softmax of its logits / temperature; the caller passes
Exponential(1) noise (k, V) in float32) and returns the drafts with q (k, V), kept on the device.
"""

from glm_mtp.reference import DraftProposer, MtpConfig, MtpWeights

from .unfused_block import PrimitiveKernels
from .proposer import OptimizedProposer, with_triton_kernels
from .state import OptimizedState

__all__ = ["OptimizedProposer", "with_triton_kernels", "OptimizedState", "PrimitiveKernels", "DraftProposer",
           "MtpConfig", "MtpWeights"]
