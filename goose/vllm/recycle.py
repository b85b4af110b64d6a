"""Token recycling inside vLLM (docs/vllm.md, "Token recycling from vLLM's logits"): the target's own next-token
predictions, read from the rows vLLM's ``compute_logits`` returns. One table serves every request; a wrong entry
only costs acceptance."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Recycler:
    """Per token and per (previous token, token) pair, the token the target last predicted after it (its first
    choice only: vLLM verifies one chain), filled from the target's logits in vLLM."""

    #: at most this many (previous, token) pairs are kept; the pair tier is emptied when it grows past it
    max_pairs: int = 1_000_000

    def __init__(self, bigram: bool = True, vocab_size: int | None = None):
        self.bigram, self.vocab_size = bigram, vocab_size
        self.rows: dict[int, int] = {}  # token -> the token predicted after it
        self.pairs: dict[tuple[int, int], int] = {}  # (previous token, token) -> the same
        self.pending: np.ndarray | None = None  # [rows] the likeliest token of each row of the last call
        self.counts = {"captured": 0, "harvested": 0, "mismatched": 0, "rows": 0}
        self.attached = False
        self.active = True  # capture the next call's rows (the proposer turns it off while its sources rest)

    def clear(self) -> None:
        """Forget every successor."""
        self.rows.clear()
        self.pairs.clear()

    def attach(self, model) -> bool:
        """Wrap ``model.compute_logits`` on this instance so each call's rows are captured; False (and
        nothing changed) when the model has no such method."""
        inner = getattr(model, "compute_logits", None)
        if not callable(inner):
            return False

        def compute_logits(hidden_states, *args, **kwargs):
            logits = inner(hidden_states, *args, **kwargs)
            self.capture(logits)
            return logits

        model.compute_logits = compute_logits
        self.attached = True
        return True

    def capture(self, logits) -> None:
        """Keep the likeliest token of each row of ``logits`` (``[rows, vocab]``); None, another shape, or while
        not :attr:`active`: nothing kept, and the next harvest reads nothing."""
        import torch

        if not self.active or logits is None or getattr(logits, "dim", lambda: 0)() != 2 or logits.shape[0] == 0:
            self.pending = None
            return
        with torch.no_grad():
            x = logits.detach()
            if self.vocab_size:
                x = x[:, : self.vocab_size]
            self.pending = x.argmax(dim=-1).cpu().numpy()
        self.counts["captured"] += 1

    def harvest(self, fed: Sequence[Sequence[int | None]], before: Sequence[int | None]) -> bool:
        """Lay the captured rows over ``fed`` (per batch row, the tokens at the positions whose logits were
        computed, in order; None where unknown, as a prompt chunk's) and write each known token's successors;
        ``before[i]`` is the token before ``fed[i][0]`` (None: unknown). False, and nothing written, when no rows
        were captured or they do not add up."""
        ids, self.pending = self.pending, None
        if ids is None:
            return False
        if sum(len(f) for f in fed) != len(ids):
            self.counts["mismatched"] += 1
            return False
        succ = ids.tolist()
        r = 0
        rows, pairs = self.rows, self.pairs
        for toks, prev in zip(fed, before):
            for t in toks:
                if t is not None:
                    rows[t] = succ[r]
                    if self.bigram and prev is not None:
                        pairs[prev, t] = succ[r]
                prev = t
                r += 1
        if len(pairs) > self.max_pairs:
            pairs.clear()
        self.counts["harvested"] += 1
        self.counts["rows"] += r
        return True

    def chain(self, prev: int | None, anchor: int, n: int) -> tuple[list[int], bool]:
        """Up to ``n`` tokens after ``anchor``, each the one predicted after the token before it (the pair's
        entry first, else the token's); and whether the first came from a pair."""
        out: list[int] = []
        p, t = prev, anchor
        paired = False
        for d in range(n):
            nxt = self.pairs.get((p, t)) if self.bigram and p is not None else None
            if d == 0:
                paired = nxt is not None
            if nxt is None:
                nxt = self.rows.get(t)
            if nxt is None:
                break
            p, t = t, nxt
            out.append(t)
        return out, paired
