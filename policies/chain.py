"""The ``chain`` policy: verify one source's proposal as a plain chain (PLD alone)."""

from __future__ import annotations

from pydantic import Field

from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, Options, TreePolicy
from goose.policies.chains import gather, rank
from goose.policies.merge import load_tiers
from goose.policies.rates import SourceRates
from goose.tree import DraftTree


class ChainOptions(Options):
    source: str | None = Field(
        None, description="source whose proposal to verify; default: chain: the chain with the most expected "
        "accepted tokens under each source's measured acceptance; proposal: the first that proposes",
    )


class ChainPolicy(TreePolicy):
    """Verify one chain, cut to the budget; nothing: a single step.

    With several sources and no ``source`` option, every source's chain is gathered each step and
    the one with the most expected accepted tokens under its source's measured acceptance is
    verified (policies/chains.py: the order of ``sources=[...]`` never decides); every chain is
    measured against the target's tokens, verified or not, so a source that starts drafting
    better chains takes over.
    """

    name = "chain"
    Options = ChainOptions

    def __init__(self, options: ChainOptions | None = None):
        super().__init__(options)
        self.rates = SourceRates()
        self._names: tuple[str, ...] | None = None
        self._sources: tuple = ()

    def consulted(self, sources):
        return frozenset({self.options.source}) if self.options.source else None

    def bind(self, sources) -> None:
        self._sources = tuple(sources)

    def attach(self, model, verifier) -> None:
        load_tiers(self.rates, self._sources, model)

    def begin(self, request) -> None:
        self.rates.begin(fresh=request is None)

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        names = [self.options.source] if self.options.source else [s.name for s in ctx.sources]
        limit = min(ctx.budget - 1, ctx.state.max_depth)
        ranked = rank(gather(ctx, names), self.rates)
        if not ranked or limit <= 0:
            return None
        lead = ranked[0]
        chains = {d.source: (self.rates.key(d.source, d.confidence)[1], d.tokens) for d in ranked}
        tree = DraftTree.from_chain(ctx.state.anchor, lead.tokens[:limit], lead.source, source=lead.source)
        tree.meta["chains"] = chains
        return tree

    def observe(self, verified) -> None:
        if verified.kind == "tree" and verified.tree is not None:
            self.rates.observe(verified.tree, verified.path, verified.bonus)

    def stats(self) -> dict:
        snap = self.rates.snapshot()
        return {"source_rates": snap} if snap else {}


class NoDraftPolicy(TreePolicy):
    """Never draft: every step is one ordinary decoding step (one token per forward)."""

    name = "none"

    def consulted(self, sources):
        return frozenset()

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        return None


class ProposalPolicy(TreePolicy):
    """Verify the first source's proposal exactly as proposed (any tree shape), cut to the budget."""

    name = "proposal"
    Options = ChainOptions

    def consulted(self, sources):
        return frozenset({self.options.source}) if self.options.source else None

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        names = [self.options.source] if self.options.source else [s.name for s in ctx.sources]
        for name in names:
            prop = ctx.proposal(name)
            if prop is None or not len(prop):
                continue
            tree = prop.as_tree(ctx.state.anchor)
            if tree.num_nodes > ctx.budget:  # keep the first budget nodes: parents precede children
                tree = tree.subtree(range(ctx.budget))
            return tree
        return None


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(ChainPolicy)
    register(NoDraftPolicy, deprecated=("greedy",))
    register(ProposalPolicy)
