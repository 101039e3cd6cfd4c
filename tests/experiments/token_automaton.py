"""A random token automaton with xgrammar's ``GrammarMatcher`` methods, for the grammar tests.

States 0..S-1; state s allows a random set of tokens, each leading to a random next state; an
optional terminal state allows nothing and ``is_terminated()`` once entered (a stop token). The
history is a stack, so ``rollback(n)`` undoes the last n accepts. ``liar`` makes ``accept_token``
refuse one token its own mask allowed (a matcher that breaks its contract).
"""

from __future__ import annotations

import torch


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(V,) bool -> (1, ceil(V / 32)) int32: bit ``j % 32`` of word ``j // 32`` set where token j
    is allowed (bit 31 is the sign bit)."""
    V = allowed.shape[0]
    words = []
    for w in range(0, V, 32):
        value = 0
        for j in range(w, min(w + 32, V)):
            if allowed[j]:
                value |= 1 << (j - w)
        words.append(value - (1 << 32) if value >= 1 << 31 else value)
    return torch.tensor([words], dtype=torch.int32)


class TokenAutomaton:
    """Args:
        vocab_size: V, the bitmask's width.
        num_states: S.
        density: the share of tokens each state allows.
        seed: the tables' generator's seed.
        terminal: whether state S-1 is terminal (entered by one allowed token of each other state).
        empty_state: whether state S-2 allows nothing (a complete grammar without a stop token).
        liar: a token ``accept_token`` refuses although the mask allowed it.
    """

    def __init__(self, vocab_size: int, num_states: int = 5, density: float = 0.3, seed: int = 0,
                 terminal: bool = False, empty_state: bool = False, liar: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.V = vocab_size
        self.allowed = torch.rand(num_states, vocab_size, generator=g) < density  # (S, V)
        self.next = torch.randint(0, num_states, (num_states, vocab_size), generator=g)  # (S, V)
        for s in range(num_states):  # every state allows a token unless it is made terminal or empty below
            if not self.allowed[s].any():
                self.allowed[s, int(torch.randint(0, vocab_size, (), generator=g))] = True
        live = num_states
        if terminal:
            live -= 1
            self.allowed[num_states - 1] = False
            self.next[self.next == num_states - 1] = 0
            for s in range(live):  # one allowed token of each state stops
                t = int(torch.nonzero(self.allowed[s])[0])
                self.next[s, t] = num_states - 1
        if empty_state:
            self.allowed[live - 1] = False
        self.terminal = num_states - 1 if terminal else None
        self.liar = liar
        self.history: list[int] = [0]

    @property
    def state(self) -> int:
        return self.history[-1]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        bitmask[index] = pack_bitmask(self.allowed[self.state])[0]

    def accept_token(self, token: int) -> bool:
        if not (0 <= token < self.V) or not bool(self.allowed[self.state, token]) or token == self.liar:
            return False
        self.history.append(int(self.next[self.state, token]))
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self.history) - 1:
            raise ValueError(f"cannot roll back {num_tokens} tokens past the start")
        del self.history[len(self.history) - num_tokens :]

    def is_terminated(self) -> bool:
        return self.terminal is not None and self.state == self.terminal

    def walk(self, tokens: list[int]) -> bool:
        """Accept ``tokens`` in turn; whether every one was allowed."""
        return all(self.accept_token(t) for t in tokens)
