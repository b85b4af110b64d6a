"""Hypothesis strategies and a losslessness test kit for draft sources."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from goose.interfaces import DraftSource, DraftState, Options, Proposal
from goose.testing.toy import reference_next
from goose.tree import DraftTree

try:  # hypothesis is a test dependency, not a runtime one
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None


def random_tree_nodes(
    rng: random.Random,
    max_nodes: int,
    vocab_size: int,
    oracle: Callable[[list[int]], int] | None,
    p_oracle: float,
    p_chain: float = 0.3,
) -> tuple[list[int], list[int]]:
    """Draw a random tree under a virtual root: (tokens, parents) with parents -1 = root.

    With probability ``p_oracle`` a node carries the oracle's token for its path (the token the
    target will want), so acceptance paths of every length occur.
    """
    n = rng.randint(0, max_nodes)
    tokens: list[int] = []
    parents: list[int] = []
    used: set[tuple[int, int]] = set()
    paths: list[list[int]] = []
    for i in range(n):
        if i and rng.random() < p_chain:
            parent = i - 1 if len(tokens) == i else rng.randint(-1, len(tokens) - 1)
        else:
            parent = rng.randint(-1, len(tokens) - 1)
        path = [] if parent < 0 else paths[parent]
        if oracle is not None and rng.random() < p_oracle:
            tok = oracle(path)
        else:
            tok = rng.randrange(vocab_size)
        if (parent, tok) in used:
            continue
        used.add((parent, tok))
        tokens.append(tok)
        parents.append(parent)
        paths.append(path + [tok])
    return tokens, parents


class ArbitraryTreeOptions(Options):
    seed: int = 0
    p_oracle: float = 0.5
    p_chain: float = 0.3
    max_nodes: int | None = None
    oracle: bool = True


class ArbitraryTreeSource(DraftSource):
    """Emits arbitrary trees (a seeded random stream, the seed drawn by Hypothesis).

    Its oracle is the toy model's from-scratch greedy rule, so it mixes right and wrong tokens at
    every depth. Use it with the ``proposal`` policy, which verifies a proposal as proposed.
    """

    name = "arbitrary"
    Options = ArbitraryTreeOptions

    def begin(self, request) -> None:
        self.rng = random.Random(self.options.seed)
        self.vocab = request.vocab_size

    def propose(self, state: DraftState) -> Proposal | None:
        seq = list(state.tokens)
        oracle = (lambda path: reference_next(seq + path, self.vocab)) if self.options.oracle else None
        max_nodes = min(state.budget - 1, self.options.max_nodes or state.budget)
        toks, pars = random_tree_nodes(
            self.rng, max_nodes, self.vocab, oracle, self.options.p_oracle, self.options.p_chain
        )
        if not toks:
            return None
        return Proposal(self.name, tuple(toks), tuple(pars))


if st is not None:

    @st.composite
    def trees(draw, max_nodes: int = 24, vocab_size: int = 50, distinct_siblings: bool = True) -> DraftTree:
        """Hypothesis strategy: an arbitrary valid DraftTree (parents drawn node by node)."""
        n = draw(st.integers(1, max_nodes))
        tokens = [draw(st.integers(0, vocab_size - 1))]
        parents = [-1]
        used = set()
        for i in range(1, n):
            p = draw(st.integers(0, i - 1 if len(tokens) == i else len(tokens) - 1))
            t = draw(st.integers(0, vocab_size - 1))
            if distinct_siblings and (p, t) in used:
                continue
            used.add((p, t))
            tokens.append(t)
            parents.append(p)
        origins = ["root"] + [draw(st.sampled_from(["spine", "branch", "x"])) for _ in tokens[1:]]
        return DraftTree.build(tokens, parents, origins)

else:  # pragma: no cover

    def trees(*a, **k):
        raise ImportError("goose.testing.trees needs hypothesis: pip install hypothesis")


class SourceLosslessnessKit:
    """Subclass in your plugin's tests and implement :meth:`make_source`; you get:

    - ``test_lossless_on_toy``: output equals from-scratch greedy decoding of the exact toy model,
      for Hypothesis-drawn prompts, lengths and budgets, with your source drafting;
    - ``test_proposals_are_valid``: every proposal your source makes is a valid tree under the root.
    """

    vocab_size = 16
    policy = "proposal"
    max_examples = 30

    def make_source(self) -> DraftSource | str | tuple:  # pragma: no cover - to override
        raise NotImplementedError

    def _run(self, prompt: Sequence[int], max_new: int, budget: int, eos: int | None):
        import goose
        from goose.testing.toy import ToyCausalLM, reference_greedy

        model = ToyCausalLM(self.vocab_size, eos_token_id=eos)
        dec = goose.compose(model, None, sources=[self.make_source()], policy=self.policy, budget=budget)
        out = dec.generate(list(prompt), max_new_tokens=max_new)
        ref = reference_greedy(prompt, max_new, self.vocab_size, [] if eos is None else [eos])
        assert out.token_ids == ref, f"diverged: got {out.token_ids}, greedy {ref}"
        return out

    def test_lossless_on_toy(self):
        from hypothesis import given, settings
        from hypothesis import strategies as hs

        @settings(max_examples=self.max_examples, deadline=None)
        @given(
            prompt=hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=30),
            max_new=hs.integers(0, 40),
            budget=hs.integers(1, 16),
            eos=hs.none() | hs.integers(0, self.vocab_size - 1),
        )
        def prop(prompt, max_new, budget, eos):
            self._run(prompt, max_new, budget, eos)

        prop()

    def test_proposals_are_valid(self):
        import goose

        out = self._run(list(range(self.vocab_size)) * 3, 30, 12, None)
        assert out.stats.forward_passes >= 1
        _ = goose  # the loop validated every tree it verified (DraftTree raises on invalid ones)
