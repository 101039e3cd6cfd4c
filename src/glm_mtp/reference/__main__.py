"""A small demo of the drafter's life cycle: ``python -m glm_mtp.reference``.

Builds the tiny random drafter, prefills it from a random prompt, then runs a few rounds of the
spec-decode loop against a stand-in target (random acceptance), printing what each call did.
"""

from __future__ import annotations

import argparse

import torch

from glm_mtp.ranges import SEED_MAX, ranged_int

from . import MtpConfig, MtpWeights, ReferenceProposer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--num-drafts", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=ranged_int(0, SEED_MAX), default=0)
    args = p.parse_args()

    cfg = MtpConfig.preset(args.preset)
    w = MtpWeights.random(cfg, seed=args.seed, dtype=torch.float32)
    prop = ReferenceProposer(w, max_seq_len=128)
    state = prop.alloc_state("cpu")
    gen = torch.Generator().manual_seed(args.seed)
    H, k = cfg.hidden_size, args.num_drafts

    prompt = torch.randint(cfg.vocab_size, (12,), generator=gen)
    hiddens = torch.randn(12, H, generator=gen)  # stand-in for the target's final-normed hiddens
    print(f"prefill: {prop.prefill_drafter(prompt, hiddens, state)} rows written for a {len(prompt)}-token prompt")
    # t_m is the newest committed token (here the target's first token after the prompt); the
    # drafter pairs it with h_{m-1} in row m-1.
    m, token, h_prev = len(prompt), int(torch.randint(cfg.vocab_size, (1,), generator=gen)), hiddens[-1]
    for r in range(args.rounds):
        drafts = prop.propose(token, h_prev, m - 1, k, state)
        accepted = int(torch.randint(k + 1, (1,), generator=gen))
        bonus = int(torch.randint(cfg.vocab_size, (1,), generator=gen))
        verified = torch.randn(k + 1, H, generator=gen)  # the target's h_m .. h_{m+k}
        prop.after_verify(accepted, state)
        caught_up = 0
        if accepted == k:  # every draft accepted: the drafter is one row behind, pair d_k with h_{m+k-1}
            caught_up = prop.catchup_drafter([drafts[-1]], verified[k - 1 : k], m + k - 1, m + k - 1, state)
        print(
            f"round {r}: propose(t={token}, position={m - 1}, k={k}) -> drafts {drafts}; accepted {accepted}, "
            f"bonus {bonus}; rows {prop.drafter_rows(state)} (+{caught_up} caught up), pair key "
            f"{prop.last_pair_key(state)}"
        )
        m, token, h_prev = m + accepted + 1, bonus, verified[accepted]
    snap = prop.export_state(state)
    print("export_state:", {k: tuple(v.shape) for k, v in snap.items()})
    prop.free_state(state)


if __name__ == "__main__":
    main()
