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


class ReferenceTreeSource(DraftSource):
    """Random trees (:func:`random_tree_nodes`) in which a node carries the next token of a known
    reference sequence (``ref_full``: prompt + expected continuation) with probability ``p``, else
    a random id below ``vocab_size``: for checking a model's tree passes against its own decoding."""

    name = "ref-trees"

    def __init__(self, ref_full: Sequence[int], seed: int, p: float, vocab_size: int, p_chain: float = 0.4):
        super().__init__()
        self.ref, self.seed, self.p, self.vocab_size, self.p_chain = list(ref_full), seed, p, vocab_size, p_chain

    def begin(self, request) -> None:
        self.rng = random.Random(self.seed)

    def propose(self, state: DraftState) -> Proposal | None:
        seq = list(state.tokens)

        def oracle(path):
            full = seq + path
            if full == self.ref[: len(full)] and len(full) < len(self.ref):
                return self.ref[len(full)]
            return self.rng.randrange(self.vocab_size)

        toks, pars = random_tree_nodes(self.rng, state.budget - 1, self.vocab_size, oracle, self.p, self.p_chain)
        return Proposal(self.name, tuple(toks), tuple(pars)) if toks else None


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
    """The checks a draft source must pass, as a pytest base class: subclass it in your plugin's
    tests and implement :meth:`make_source`. Every check runs your source on Goose's exact toy
    model (``goose.testing.ToyCausalLM``, whose greedy and sampled continuations are known without
    a forward pass), under :attr:`policy`:

    - ``test_lossless_on_toy``: the output equals greedy decoding, for Hypothesis-drawn prompts,
      lengths, budgets and eos ids;
    - ``test_proposals_are_drafted_and_valid``: on a repetitive prompt the source proposes at least
      once (a successor source: answers ``successors`` at least once; unless :attr:`require_drafts`
      is False), each proposal passes the boundary checks of
      ``goose.interfaces.check_proposal`` (ids in the vocabulary, parents, no duplicate siblings,
      finite confidence in [0, 1], credited to the source), ``state.tokens`` was the same sequence
      after every ``propose`` as before it, the verified trees hold nodes credited to the source
      (unless :attr:`require_drafts` is False), every such node is one it drafted at that step (a
      path of its proposal, or a successor it gave for the node's parent), and
      ``stats.per_source[<its name>]["drafted"]`` counts exactly those nodes;
    - ``test_generations_on_one_decoder``: several generations in a row on one decoder (the same
      source instance, so state kept across requests, e.g. a history filled in ``end``, is used),
      each equal to greedy decoding, ``end`` called once per generation;
    - ``test_sampling_is_seed_identical``: sampling (temperature, top-k) with a seeded generator
      draws exactly what one-token sampling of the toy model draws with the same seed.

    Attributes a subclass may set:

    - ``vocab_size`` (16): the toy model's vocabulary;
    - ``policy`` ("proposal"): the tree policy the source drafts under ("proposal" verifies the
      proposal as proposed, any tree shape; "spine" for a chain source beside "tr", ...);
    - ``policy_options`` (None): options of that policy, as ``goose.compose(policy_options=...)``
      takes them (e.g. ``{"latency": {1: 1.0, 128: 1.0}, "source_priors": {...}}`` for ``spine-fit``);
    - ``extra_sources`` (()): sources composed after yours (e.g. ("tr",) for the spine policies);
    - ``max_examples`` (30): Hypothesis examples per property;
    - ``require_drafts`` (True): whether the source must propose on a repetitive prompt.
    """

    vocab_size = 16
    policy = "proposal"
    policy_options: dict | None = None
    extra_sources: tuple = ()
    max_examples = 30
    require_drafts = True

    def make_source(self) -> DraftSource | str | tuple:  # pragma: no cover - to override
        raise NotImplementedError

    def _decoder(self, budget: int = 16, eos: int | None = None, spy: bool = False):
        import goose
        from goose.testing.toy import ToyCausalLM

        model = ToyCausalLM(self.vocab_size, eos_token_id=eos, max_positions=4096)
        src = self.make_source()
        dec = goose.compose(model, None, sources=[src, *self.extra_sources], policy=self.policy,
                             policy_options=self.policy_options, budget=budget)
        if spy:
            _spy(dec, self.vocab_size)
        return dec

    def _run(self, prompt: Sequence[int], max_new: int, budget: int, eos: int | None, dec=None):
        from goose.testing.toy import reference_greedy

        dec = dec or self._decoder(budget, eos)
        out = dec.generate(list(prompt), max_new_tokens=max_new, do_sample=False)
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

    def test_proposals_are_drafted_and_valid(self):
        dec = self._decoder(12, spy=True)
        out = self._run(list(range(self.vocab_size)) * 3, 30, 12, None, dec)
        seen = dec._kit_spy
        # a backstop: the loop itself refuses these (a DraftSourceError) before they get here
        assert not seen["mutated"], f"state.tokens changed during propose(): {seen['mutated'][:3]}"
        assert not seen["invalid"], f"invalid proposals: {seen['invalid'][:3]}"
        # what the loop does not check: every verified node credited to the source is one the source drafted at
        # that step (a path of its proposal under that anchor, or a successor it gave for that node's parent)
        name, credited, foreign = seen["name"], 0, []
        for step, tree in enumerate(seen["trees"].get(0, ())):
            paths = seen["paths"].get((0, step), {})
            for i in range(1, tree.num_nodes):
                if name not in tree.credited(i):
                    continue
                credited += 1
                path, j = [], i
                while j > 0:
                    path.append(tree.tokens[j])
                    j = tree.parents[j]
                par = tree.parents[i]
                if tuple(reversed(path)) not in paths.get(tree.tokens[0], ()) and \
                        tree.tokens[i] not in seen["successors"].get((0, step, tree.tokens[par]), ()):
                    foreign.append((step, tree.label(i), tuple(reversed(path))))
        assert not foreign, f"nodes credited to {name!r} that it never drafted (step, node, path): {foreign[:3]}"
        got = out.stats.per_source.get(name, {}).get("drafted", 0)
        assert got == credited, f"stats.per_source[{name!r}] counts {got} drafted tokens; the verified trees credit it {credited}"
        if self.require_drafts:
            assert seen["proposals"] > 0, "the source never proposed on a repetitive prompt (set require_drafts = False if that is intended)"
            assert credited > 0, f"the source proposed {seen['proposals']} times but no verified tree holds a node credited to {name!r}"

    def test_generations_on_one_decoder(self):
        from hypothesis import given, settings
        from hypothesis import strategies as hs

        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompts=hs.lists(hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=20),
                                min_size=2, max_size=4),
               max_new=hs.integers(8, 30))  # long enough to draft (a 1-token generation drafts nothing)
        def prop(prompts, max_new):
            dec = self._decoder(16, spy=True)
            for prompt in [*prompts, prompts[0]]:  # the first prompt again, last: what a history would serve
                self._run(prompt, max_new, 16, None, dec)
            assert dec._kit_spy["ends"] == len(prompts) + 1, "end() was not called once per generation"

        prop()

    def test_sampling_is_seed_identical(self):
        import torch
        from hypothesis import given, settings
        from hypothesis import strategies as hs

        from goose.testing.toy import reference_sample
        from goose.verifiers.sampling import Sampling, build_processors

        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompt=hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=20),
               max_new=hs.integers(8, 30), seed=hs.integers(0, 2**16),
               temperature=hs.sampled_from([0.5, 1.0, 1.5]), top_k=hs.sampled_from([None, 4]))
        def prop(prompt, max_new, seed, temperature, top_k):
            dec = self._decoder(16)
            p = {"do_sample": True, "temperature": temperature, "top_k": top_k}
            out = dec.generate(prompt, max_new_tokens=max_new, generator=torch.Generator().manual_seed(seed), **p)
            procs = build_processors(Sampling(**p), len(prompt), [])
            ref = reference_sample(prompt, max_new, self.vocab_size, procs, torch.Generator().manual_seed(seed))
            assert out.token_ids == ref, f"sampling diverged: got {out.token_ids}, one-token sampling {ref}"

        prop()


def _spy(dec, vocab_size: int) -> None:
    """Record, on ``dec._kit_spy``, every proposal of the decoder's first source as it leaves it
    (checked), whether ``state.tokens`` changed during propose, the ``end`` calls, and, per generation
    (the number of ``end`` calls before it) and step, the root-to-node token paths of its proposals by
    anchor (``paths``), the successors it gave by parent token (``successors``) and the verified trees."""
    from goose.errors import DraftSourceError
    from goose.interfaces import check_proposal

    src = dec._idle[0].sources[0]
    seen = {"name": src.name, "proposals": 0, "invalid": [], "mutated": [], "ends": 0,
            "paths": {}, "successors": {}, "trees": {}}
    dec._kit_spy = seen
    propose, end, observe = src.propose, src.end, src.observe

    def spied_propose(state):
        before = list(state.tokens)
        prop = propose(state)
        if list(state.tokens) != before:
            seen["mutated"].append((before, list(state.tokens)))
        if prop is not None:
            seen["proposals"] += 1
            try:
                check_proposal(src.name, prop, vocab_size)
            except DraftSourceError as exc:
                seen["invalid"].append(str(exc))
            else:
                paths: list[tuple[int, ...]] = []
                for t, p in zip(prop.tokens, prop.parents):
                    paths.append((*(paths[p] if p >= 0 else ()), int(t)))
                mine = seen["paths"].setdefault((seen["ends"], state.step), {})
                mine.setdefault(state.anchor, set()).update(paths)
        return prop

    def spied_observe(verified):
        if verified.kind == "tree" and verified.tree is not None:
            seen["trees"].setdefault(seen["ends"], []).append(verified.tree)
        return observe(verified)

    def spied_end(output):
        seen["ends"] += 1
        return end(output)

    src.propose, src.end, src.observe = spied_propose, spied_end, spied_observe
    if src.provides_successors:  # a successor source drafts through successors()
        successors = src.successors

        def spied_successors(token, prev):
            ids, scores = successors(token, prev)
            if len(ids):
                seen["proposals"] += 1
                step = len(seen["trees"].get(seen["ends"], ()))  # drafting for the step after the trees verified so far
                seen["successors"].setdefault((seen["ends"], step, int(token)), set()).update(int(t) for t in ids)
            return ids, scores

        src.successors = spied_successors
