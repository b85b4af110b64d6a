"""The policies' shared wiring: :class:`RatedPolicy` (a policy that learns its chain sources' acceptance) and
:class:`MergingPolicy` (one that merges every source's chain into its tree: ``spine-tree``, ``isotropic``). The
chains are ranked and merged in :mod:`goose.policies.chains`."""

from __future__ import annotations

from collections.abc import Sequence

from goose.policies import tiers
from goose.policies.chains import Drafted, gather, unextended
from goose.errors import InvalidInputError
from goose.interfaces import DraftContext, DraftSource, Options, TreePolicy
from goose.policies.rates import SourceRates

EXTENSION = 40  # extra nodes a fully confident step may use (the paper's +40)
MIN_SCORE = 0.01  # successors scoring below this are not drafted (the merging policies' branches)
TRUST_MIN = 0.2  # the depth-1 rate below which a (source, tier)'s confidence buys nothing (policies' trust_min)


def resolve_spine_source(policy: str, wanted: str | None, sources: Sequence[DraftSource]) -> str | None:
    """``wanted`` (a policy's ``spine_source``), checked to be among ``sources``; None when it is unset."""
    if not wanted:
        return None
    names = [s.name for s in sources]
    if wanted not in names:
        raise InvalidInputError(
            f"policy {policy!r}: spine_source={wanted!r} is not among the decoder's sources "
            f"{names}. Hint: add it to sources=[...] or set spine_source=None to use the first "
            "chain source."
        )
    return wanted


class RatedPolicy(TreePolicy):
    """A policy that learns its chain sources' acceptance as it decodes (:attr:`rates`), from the tiers measured
    with the model, booking every chain its trees lay out (``tree.meta["chains"]``)."""

    def __init__(self, options: Options | None = None):
        super().__init__(options)
        self._sources: tuple[DraftSource, ...] = ()
        self.rates = SourceRates()  # a pessimistic prior, carrying half of what it learns into the next request

    def bind(self, sources: Sequence[DraftSource]) -> None:
        self._sources = tuple(sources)

    def attach(self, model, verifier) -> None:
        """The model is known: every chain source's rates start at the tiers measured with it, where it has any."""
        for name, found in tiers.for_sources(self._sources, model).items():
            self.rates.set_tiers(name, found)

    def begin(self, request) -> None:
        self.rates.begin(fresh=request is None)

    def observe(self, verified) -> None:
        if verified.kind == "tree" and verified.tree is not None:
            self.rates.observe(verified.tree, verified.path, verified.bonus)


class MergingPolicy(RatedPolicy):
    """Which sources a merging policy asks for chains (all of them), the spine source its options force (if
    any), and the budget a confident chain extends."""

    def __init__(self, options: Options | None = None):
        super().__init__(options)
        self._spine: str | None = None
        self._chains: tuple[str, ...] = ()
        self._bound = False

    def bind(self, sources: Sequence[DraftSource]) -> None:
        if not sources:
            raise InvalidInputError(
                f"policy {self.name!r} needs at least one draft source: a chain source (e.g. 'pld') for the "
                "spine and/or a successor source (e.g. 'tr') for the branches; got sources=[]. "
                "Hint: sources=['pld', 'tr']."
            )
        super().bind(sources)
        self._spine = resolve_spine_source(self.name, self.options.spine_source, sources)
        # every source may give a chain (a successor-only source's propose costs one call returning None)
        self._chains = tuple(s.name for s in sources)
        self._bound = True

    def gather_chains(self, ctx: DraftContext) -> list[Drafted]:
        """This step's chains; unextended, at confidence 0, where confidence is not used."""
        chains = gather(ctx, self._chains)
        return chains if self.uses_confidence() else unextended(chains)

    def trusted(self, drafted: Drafted | None) -> float:
        """The confidence ``drafted`` may spend (extension, spine share, bypass): :meth:`SourceRates.trusted`
        at this policy's ``trust_min``; 0 where confidence is not used."""
        return self.rates.trusted(drafted, self.options.trust_min) if self.uses_confidence() else 0.0

    def uses_confidence(self) -> bool:
        """Whether a chain's confidence buys anything (extension, spine share, bypass)."""
        return True

    def extension(self) -> int:
        """The extra nodes a fully confident chain's step may use."""
        return EXTENSION

    def consulted(self, sources: Sequence[DraftSource]) -> frozenset[str] | None:
        return frozenset(s.name for s in sources)  # every chain merges into the tree, every successor source branches

    def max_nodes(self, budget: int) -> int:
        return budget + (self.extension() if self.uses_confidence() else 0)
