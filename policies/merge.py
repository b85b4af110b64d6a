"""The wiring every merging policy shares: which sources it asks for chains, the spine source its options
force, the measured tiers its rates start at, and the budget a confident chain extends.

The chains themselves are ranked and merged in :mod:`goose.policies.chains`, with the acceptance each source has
earned (:class:`goose.policies.rates.SourceRates`); this module holds what is policy: :class:`MergingPolicy` and
its helpers.
"""

from __future__ import annotations

from collections.abc import Sequence

from goose.policies import tiers
from goose.policies.chains import Drafted
from goose.errors import InvalidInputError
from goose.interfaces import DraftSource, Options, TreePolicy
from goose.policies.rates import SourceRates


EXTENSION = 40  # extra nodes a fully confident step may use (the paper's +40)
MIN_SCORE = 0.01  # successors scoring below this are not drafted (the merging policies' branches)
TRUST_MIN = 0.2  # the depth-1 rate below which a (source, tier)'s confidence buys nothing (policies' trust_min)


def load_tiers(rates: SourceRates, sources: Sequence[DraftSource], model) -> None:
    """Give ``rates`` every chain source's confidence tiers measured with ``model`` (``goose tiers``;
    :func:`goose.policies.tiers.for_sources`), where it has any."""
    for name, found in tiers.for_sources(sources, model).items():
        rates.set_tiers(name, found)


def chain_sources(sources: Sequence[DraftSource]) -> tuple[str, ...]:
    """Every source a chain may come from: all of them (a successor source that proposes nothing
    costs one call returning None)."""
    return tuple(s.name for s in sources)


def resolve_spine_source(policy: str, wanted: str | None, sources: Sequence[DraftSource]) -> str | None:
    """The name of the source whose chain forms the spine, or None when there is none.

    ``wanted`` names it explicitly (it must be bound); None picks the first source that does not
    provide successors.
    """
    names = [s.name for s in sources]
    if wanted is not None:
        if wanted not in names:
            raise InvalidInputError(
                f"policy {policy!r}: spine_source={wanted!r} is not among the decoder's sources "
                f"{names}. Hint: add it to sources=[...] or set spine_source=None to use the first "
                "chain source."
            )
        return wanted
    for s in sources:
        if not s.provides_successors:
            return s.name
    return None


def spine_and_successors(spine: str | None, sources: Sequence[DraftSource]) -> frozenset[str]:
    """What a spine-shaped policy drafts from: its spine source and every successor source."""
    return frozenset({*([spine] if spine else []), *(s.name for s in sources if s.provides_successors)})


def require_some_source(policy: str, sources: Sequence[DraftSource]) -> None:
    if not sources:
        raise InvalidInputError(
            f"policy {policy!r} needs at least one draft source: a chain source (e.g. 'pld') for the "
            "spine and/or a successor source (e.g. 'tr') for the branches; got sources=[]. "
            "Hint: sources=['pld', 'tr']."
        )


class MergingPolicy(TreePolicy):
    """The wiring of a policy that merges every source's chain into its tree (``spine-tree``, ``isotropic``):
    which sources it asks for chains, the spine source its options force (if any), the measured source rates
    (:meth:`make_rates`), and the budget a confident chain extends (options ``confidence``, ``extension``)."""

    def __init__(self, options: Options | None = None):
        super().__init__(options)
        self._spine: str | None = None
        self._chains: tuple[str, ...] = ()
        self._sources: tuple[DraftSource, ...] = ()
        self._bound = False
        self.rates = self.make_rates()

    def make_rates(self) -> SourceRates:
        """The per-source chain acceptance this policy learns (defaults: a pessimistic prior)."""
        return SourceRates()

    def bind(self, sources: Sequence[DraftSource]) -> None:
        require_some_source(self.name, sources)
        forced = self.options.spine_source
        self._spine = resolve_spine_source(self.name, forced, sources) if forced else None
        self._chains = chain_sources(sources)
        self._sources = tuple(sources)
        self._bound = True

    def attach(self, model, verifier) -> None:
        """The model is known: every chain source's rates start at the tiers measured with it."""
        load_tiers(self.rates, self._sources, model)

    def trusted(self, drafted: Drafted | None) -> float:
        """The confidence ``drafted`` may spend (extension, spine share, bypass): :meth:`SourceRates.trusted`
        at this policy's ``trust_min``; 0 where confidence is not used (:meth:`uses_confidence`)."""
        if not self.uses_confidence():
            return 0.0
        return self.rates.trusted(drafted, self.options.trust_min)

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
