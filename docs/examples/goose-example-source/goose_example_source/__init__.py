"""An example Goose plugin: the "last-successor" draft source.

It remembers, for every token, the token that followed it the last time it was committed, and
drafts a chain by following those links from the anchor. Small, but a real drafter: on
repetitive text it proposes useful chains.

Install (``pip install ./docs/examples/goose-example-source``) and use it by name:

    goose.compose(model, tok, sources=["last-successor"], policy="chain")
"""

from __future__ import annotations

from pydantic import Field

import goose


class LastSuccessorOptions(goose.Options):
    max_len: int = Field(8, ge=1, le=256, description="longest chain drafted")


class LastSuccessorSource(goose.DraftSource):
    """Follow 'what came after this token last time' links from the anchor."""

    name = "last-successor"
    Options = LastSuccessorOptions

    def begin(self, request: goose.Request) -> None:
        self.next_of: dict[int, int] = {}
        self.seen = 0

    def propose(self, state: goose.DraftState) -> goose.Proposal | None:
        toks = state.tokens
        for i in range(max(self.seen - 1, 0), len(toks) - 1):  # index what was committed since
            self.next_of[toks[i]] = toks[i + 1]
        self.seen = len(toks)
        chain, t = [], state.anchor
        while len(chain) < self.options.max_len and t in self.next_of:
            t = self.next_of[t]
            chain.append(t)
        return goose.Proposal.chain(self.name, chain) if chain else None


@goose.hookimpl
def goose_register_sources(register) -> None:
    register(LastSuccessorSource)
