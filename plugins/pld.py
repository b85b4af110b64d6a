"""Context matching (prompt lookup decoding, docs/algorithm.md section 4): copy what followed an earlier occurrence
of the current suffix. The n-gram index is incremental (each step indexes only the positions committed since the
last), so a proposal's cost does not grow with the text; per n-gram it keeps the first and last occurrence, the
count and whether every occurrence was followed by the same token (consensus)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from goose.hookspecs import hookimpl
from goose.interfaces import DraftSource, DraftState, Options, Proposal, Request


EXTEND_ABOVE = 0.6  # a chain is extended when its confidence exceeds this
MAX_EXTENDED = 100  # cap on an extended chain (times its confidence)
LONG_MATCH = 8  # a match this long counts as a long match


class PLDOptions(Options):
    ngram_sizes: tuple[int, ...] = Field((5, 4, 3), description="n-gram sizes tried, longest first",
        json_schema_extra={"why": "shorter n-grams match more often but less reliably: tune to the text (code, prose)"},
    )
    max_chain: int = Field(20, ge=1, le=4096, description="tokens copied per match",
        json_schema_extra={"why": "a longer copy pays where the text repeats long spans (code edits, vLLM chains)"},
    )
    occurrence: Literal["earliest", "latest"] = Field(
        "earliest", description="which earlier occurrence to copy from (classic PLD uses 'latest')",
        json_schema_extra={"why": "'latest' reproduces classic prompt lookup (preset pld-latest)"},
    )
    extend: bool = Field(True, description="chain extension: re-query from the end of the draft",
        json_schema_extra={"why": "off: the paper's ablation without chain extension"},
    )

    @field_validator("ngram_sizes")
    @classmethod
    def _sizes(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(n < 1 for n in v):
            raise ValueError(f"ngram_sizes must be non-empty positive ints, got {v}; e.g. (5, 4, 3)")
        return tuple(sorted(set(v), reverse=True))


class _Entry:
    __slots__ = ("first", "last", "count", "follower", "agree")

    def __init__(self, end: int, follower: int):
        self.first = self.last = end
        self.count = 1
        self.follower = follower
        self.agree = True


class NgramIndex:
    """Incremental index of n-grams that have a following token."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = tuple(sizes)
        self.tables: dict[int, dict[tuple[int, ...], _Entry]] = {n: {} for n in self.sizes}
        self.indexed = 0  # end positions < indexed are in the tables

    def update(self, tokens: Sequence[int]) -> None:
        """Index every n-gram ending at e for e <= len(tokens) - 2 (those with a follower)."""
        last_end = len(tokens) - 2
        for e in range(self.indexed, last_end + 1):
            follower = tokens[e + 1]
            for n in self.sizes:
                if e - n + 1 < 0:
                    continue
                key = tuple(tokens[e - n + 1 : e + 1])
                table = self.tables[n]
                ent = table.get(key)
                if ent is None:
                    table[key] = _Entry(e, follower)
                else:
                    ent.last = e
                    ent.count += 1
                    if follower != ent.follower:
                        ent.agree = False
        self.indexed = max(self.indexed, last_end + 1)

    def lookup(self, suffix: Sequence[int]) -> tuple[int, _Entry] | None:
        """Longest n whose last-n tokens of ``suffix`` occurred before: (n, entry)."""
        for n in self.sizes:
            if len(suffix) < n:
                continue
            ent = self.tables[n].get(tuple(suffix[-n:]))
            if ent is not None:
                return n, ent
        return None


def confidence(length: int, consensus: bool, long_match: int = LONG_MATCH) -> float:
    """The reference confidence score of a context match of ``length`` tokens."""
    if length <= 0:
        return 0.0
    if consensus:
        return 1.0
    if length >= long_match:
        return min(0.9, 0.7 + 0.2 * (length - long_match) / 12)
    return 0.6 * length / long_match


class PLDSource(DraftSource):
    """Context matches (PLD): n-grams (5, 4, 3) longest first, earliest occurrence, chain extension."""

    name = "pld"
    Options = PLDOptions

    def begin(self, request: Request) -> None:
        self.index = NgramIndex(self.options.ngram_sizes)

    def _copy(self, tokens: Sequence[int], ent: _Entry) -> list[int]:
        start = (ent.first if self.options.occurrence == "earliest" else ent.last) + 1
        return list(tokens[start : start + self.options.max_chain])

    def propose(self, state: DraftState) -> Proposal | None:
        o = self.options
        tokens = state.tokens
        self.index.update(tokens)
        hit = self.index.lookup(tokens)
        if hit is None:
            return None
        _, ent = hit
        consensus = ent.count >= 2 and ent.agree
        chain = self._copy(tokens, ent)
        if not chain:
            return None
        conf = confidence(len(chain), consensus)
        base_len = len(chain)
        if o.extend and conf > EXTEND_ABOVE:
            cap = min(MAX_EXTENDED, int(100 * conf))
            tail = list(tokens[-max(o.ngram_sizes) :])
            while len(chain) < cap:
                hit = self.index.lookup(tail + chain)
                if hit is None:
                    break
                _, ent = hit
                # Each re-query appends its whole copy (up to max_chain), so the chain may pass
                # the cap by less than one copy, as in the reference; the tree policy cuts it.
                more = self._copy(tokens, ent)
                if not more:
                    break
                chain.extend(more)
                # At confidence 1.0 go on only while each proposal is itself a consensus match
                # (the first one that is not is still appended, as in the reference).
                if conf >= 1.0 and not (ent.count >= 2 and ent.agree):
                    break
        return Proposal.chain(self.name, chain, conf, consensus=consensus, match_len=base_len,
                              extended=len(chain) - base_len)


@hookimpl(trylast=True)
def goose_register_sources(register) -> None:
    register(PLDSource, aliases=("context",))
    register(PLDSource, name="pld-latest", defaults={"occurrence": "latest"})
