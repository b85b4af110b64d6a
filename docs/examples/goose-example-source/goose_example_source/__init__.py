"""An example Goose plugin with a component in every role: two draft sources (one for each role a source
can play), a tree policy and a verifier.

- ``last-successor`` (a chain source): it remembers, for every token, the token that followed it
  the last time it was committed, and drafts a chain by following those links from the anchor.
  Small, but a real drafter: on repetitive text it proposes useful chains.
- ``context-bigram`` (a successor source): for every token, how often each token followed it in
  this request's text (prompt and committed tokens); ``successors(token, prev)`` answers the most
  frequent followers, best first. A tree policy hangs them as branches; composed with ``tr`` its
  answers merge with token recycling's, ranked by what each has earned (docs/plugins.md).

- ``longest-chain`` (a tree policy): verifies the longest chain any source proposed this step (a tree
  proposal's first path), cut to the budget, credited to every source that proposed it.
- ``tree-sizes`` (a verifier): the built-in verifier, wrapped (not subclassed); it counts the trees it verified
  by size (``stats.extra["verifier"]["tree_sizes"]``) and passes the loop's sampling rule on, so it samples too.
  It leaves the speed protocol to its defaults, so a fitted policy (``spine-fit``) calibrates it by timing
  its own ``verify``, under a latency curve of its own.

Install (``pip install ./docs/examples/goose-example-source``) and use them by name:

    goose.compose(model, tok, sources=["last-successor"], policy="chain")
    goose.compose(model, tok, sources=["pld", "tr", "context-bigram"], policy="spine")
    goose.compose(model, tok, sources=["pld", "last-successor"], policy="longest-chain", verifier="tree-sizes")

Each is checked by Goose's kits (``goose.testing``: SourceLosslessnessKit, PolicyLosslessnessKit,
VerifierLosslessnessKit) in Goose's tests/test_plugins.py.
"""

from __future__ import annotations

from collections import Counter

from pydantic import Field

import goose
from goose.verifiers.transformers_tree import TransformersVerifier


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


class LongestChainPolicy(goose.TreePolicy):
    """Verify the longest chain any source proposed this step, cut to the budget."""

    name = "longest-chain"

    def shape(self, ctx: goose.DraftContext) -> goose.DraftTree | None:
        chains = {}
        for name, prop in ctx.proposals().items():
            chains.setdefault(prop.first_chain(), []).append(name)
        if not chains:
            return None
        best = max(chains, key=lambda c: (len(c), c))  # ties: the larger tokens, never the order of the sources
        chain = best[: min(ctx.budget - 1, ctx.state.max_depth)]
        if not chain:
            return None
        by = tuple(sorted(chains[best]))
        return goose.DraftTree.build((ctx.state.anchor, *chain), range(-1, len(chain)), ("root",) + ("chain",) * len(chain),
                                     route="longest-chain", sources=((),) + (by,) * len(chain))


class CountingVerifier(goose.Verifier):
    """The built-in tree verifier, wrapped: counts the verified trees by size, and samples as it does."""

    name = "tree-sizes"
    supports_rules = True

    def __init__(self, options=None):
        super().__init__(options)
        self.inner = TransformersVerifier()
        self.sizes: Counter = Counter()

    def bind(self, model) -> None:
        super().bind(model)  # vocab_size, max_positions
        self.inner.bind(model)

    def check_request(self, prompt_len: int, max_new_tokens: int, max_depth: int) -> None:
        self.inner.check_request(prompt_len, max_new_tokens, max_depth)

    def prefill(self, prompt_ids, keep=None, rule=None) -> goose.Verified:
        self.sizes = Counter()
        return self.inner.prefill(prompt_ids, keep, rule)  # the request's sampling rule, passed on

    def verify(self, tree: goose.DraftTree, rule=None) -> goose.Verified:
        self.sizes[tree.num_nodes] += 1
        return self.inner.verify(tree, rule)

    def end(self) -> None:
        self.inner.end()

    def stats(self) -> dict:
        return {**self.inner.stats(), "tree_sizes": dict(sorted(self.sizes.items()))}


@goose.hookimpl
def goose_register_policies(register) -> None:
    register(LongestChainPolicy)


@goose.hookimpl
def goose_register_verifiers(register) -> None:
    register(CountingVerifier)
