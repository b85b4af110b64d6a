"""The ``chain`` policy (verify one chain: PLD alone), ``proposal`` (one proposal as proposed) and ``none``."""

from __future__ import annotations

from pydantic import Field

from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, Options, TreePolicy
from goose.policies.chains import gather, laid_out, rank
from goose.policies.merge import RatedPolicy
from goose.tree import DraftTree


class ChainOptions(Options):
    source: str | None = Field(
        None, description="source whose proposal to verify; default: chain: the chain with the most expected "
        "accepted tokens under each source's measured acceptance; proposal: the first that proposes",
        json_schema_extra={"why": "verify one named source's chain instead of the best-ranked one"},
    )


class _OneSource(TreePolicy):
    """A policy that verifies one source's proposal: option ``source``, else any source."""

    Options = ChainOptions

    def consulted(self, sources):
        return frozenset({self.options.source}) if self.options.source else None

    def _names(self, ctx: DraftContext) -> list[str]:
        return [self.options.source] if self.options.source else [s.name for s in ctx.sources]


class ChainPolicy(_OneSource, RatedPolicy):
    """Verify one chain, cut to the budget; nothing: a single step.

    With several sources and no ``source`` option, the chain with the most expected accepted tokens under
    its source's measured acceptance is verified (policies/chains.py); every chain is booked against the
    target's tokens, verified or not, so a source that starts drafting better chains takes over.
    """

    name = "chain"

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        limit = min(ctx.budget - 1, ctx.state.max_depth)
        ranked = rank(gather(ctx, self._names(ctx)), self.rates)
        if not ranked or limit <= 0:
            return None
        lead = ranked[0]
        tree = DraftTree.from_chain(ctx.state.anchor, lead.tokens[:limit], lead.source, source=lead.source)
        tree.meta["chains"] = laid_out(ranked, self.rates)
        return tree

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


class ProposalPolicy(_OneSource):
    """Verify the first source's proposal exactly as proposed (any tree shape), cut to the budget."""

    name = "proposal"

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        for name in self._names(ctx):
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
