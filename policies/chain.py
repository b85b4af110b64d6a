"""The ``chain`` policy: verify one source's proposal as a plain chain (PLD alone)."""

from __future__ import annotations

from pydantic import Field

from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, Options, TreePolicy
from goose.tree import DraftTree


class ChainOptions(Options):
    source: str | None = Field(None, description="source whose proposal to verify; default: the first that proposes")


class ChainPolicy(TreePolicy):
    """Verify the first source's proposal as one chain, cut to the budget; nothing: a single step."""

    name = "chain"
    Options = ChainOptions

    def consulted(self, sources):
        return frozenset({self.options.source}) if self.options.source else None

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        names = [self.options.source] if self.options.source else [s.name for s in ctx.sources]
        limit = min(ctx.budget - 1, ctx.state.max_depth)
        for name in names:
            prop = ctx.proposal(name)
            if prop is None or not len(prop):
                continue
            if not prop.is_chain:  # a tree proposal: keep its first root-to-leaf chain
                chain, node = [], -1
                for i, p in enumerate(prop.parents):
                    if p == node:
                        chain.append(prop.tokens[i])
                        node = i
            else:
                chain = list(prop.tokens)
            if limit <= 0:
                return None
            return DraftTree.from_chain(ctx.state.anchor, chain[:limit], prop.source)
        return None


class GreedyPolicy(TreePolicy):
    """Never draft: every step is one ordinary decoding step (plain greedy decoding)."""

    name = "greedy"

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
                k = ctx.budget
                tree = DraftTree(tree.tokens[:k], tree.parents[:k], tree.origins[:k],
                                 None if tree.scores is None else tree.scores[:k], tree.route)
            return tree
        return None


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(ChainPolicy)
    register(GreedyPolicy, aliases=("none",))
    register(ProposalPolicy)
