"""An example Goose plugin with two draft sources, one for each role a source can play.

- ``last-successor`` (a chain source): it remembers, for every token, the token that followed it
  the last time it was committed, and drafts a chain by following those links from the anchor.
  Small, but a real drafter: on repetitive text it proposes useful chains.
- ``context-bigram`` (a successor source): for every token, how often each token followed it in
  this request's text (prompt and committed tokens); ``successors(token, prev)`` answers the most
  frequent followers, best first. A tree policy hangs them as branches; composed with ``tr`` its
  answers merge with token recycling's, ranked by what each has earned (docs/plugins.md).

Install (``pip install ./docs/examples/goose-example-source``) and use them by name:

    goose.compose(model, tok, sources=["last-successor"], policy="chain")
    goose.compose(model, tok, sources=["pld", "tr", "context-bigram"], policy="spine")
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


class ContextBigramOptions(goose.Options):
    k: int = Field(4, ge=1, le=64, description="most followers answered per token")


class ContextBigramSource(goose.DraftSource):
    """A branch source: the tokens that most often followed a token in this request's text."""

    name = "context-bigram"
    Options = ContextBigramOptions
    provides_successors = True

    def begin(self, request: goose.Request) -> None:
        self.follow: dict[int, dict[int, int]] = {}
        self.last: int | None = None
        self.add(request.prompt_ids)

    def add(self, tokens) -> None:
        for t in tokens:
            t = int(t)
            if self.last is not None:
                row = self.follow.setdefault(self.last, {})
                row[t] = row.get(t, 0) + 1
            self.last = t

    def observe(self, verified: goose.Verified) -> None:
        if verified.kind == "tree":  # what was committed: the accepted tokens, then the bonus token
            self.add(verified.accepted)
            if verified.bonus is not None:
                self.add((verified.bonus,))

    def successors(self, token: int, prev: int | None):
        row = self.follow.get(token)
        if not row:
            return (), ()
        best = sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[: self.options.k]
        total = sum(row.values())
        return [t for t, _ in best], [c / total for _, c in best]


@goose.hookimpl
def goose_register_sources(register) -> None:
    register(LastSuccessorSource)
    register(ContextBigramSource)
