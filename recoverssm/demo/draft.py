"""The demo's draft: proposes ``k`` tokens per request from that request's own history.

Prompt-lookup style: find the most recent earlier occurrence of the last ``n`` tokens (``n`` from
``order - 1`` down to 1) in the request's prompt + generated tokens and propose what followed it.
When nothing matches, fall back to a stateless draft built from the target's own embedding and LM
head with perturbed weights (:meth:`TinyModel.next_token_table`). Each request also replaces a draft
token with a random one with its own probability (``noise``), so acceptance differs per request.
Greedy decoding of a small random model soon falls into loops, which the lookup then predicts well:
acceptance grows as a request's history does.
"""
from __future__ import annotations

import random
from typing import Optional, Sequence


class NgramDraft:
    """Draft of one request. ``fallback[t]``: the token proposed after ``t`` when no n-gram matches."""

    def __init__(self, fallback: Sequence[int], vocab: int, *, order: int = 4, noise: float = 0.0,
                 seed: int = 0):
        self.fallback = list(fallback)
        self.vocab = vocab
        self.order = order
        self.noise = noise
        self.rng = random.Random(seed)
        self.lookups = 0
        self.hits = 0

    def _lookup(self, history: list[int], context: list[int]) -> Optional[int]:
        """The token that followed the most recent earlier occurrence of the longest suffix of
        ``context`` found in ``history`` (``context`` = ``history`` + the drafts so far)."""
        for n in range(min(self.order - 1, len(context)), 0, -1):
            suffix = context[-n:]
            # Search strictly earlier occurrences: the match must be followed by a known token.
            for start in range(len(history) - n - 1, -1, -1):
                if history[start:start + n] == suffix:
                    return history[start + n]
        return None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """``k`` draft tokens to follow ``history`` (prompt + generated, last token included)."""
        history = list(history)
        context = list(history)
        drafts = []
        for _ in range(k):
            self.lookups += 1
            tok = self._lookup(history, context)
            if tok is None:
                tok = self.fallback[context[-1]]
            else:
                self.hits += 1
            if self.noise and self.rng.random() < self.noise:
                tok = self.rng.randrange(self.vocab)
            drafts.append(tok)
            context.append(tok)
        return drafts
