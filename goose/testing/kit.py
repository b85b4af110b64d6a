"""Hypothesis strategies, draft sources drawing right and wrong tokens, and the losslessness test kits for
draft sources and tree policies."""

from __future__ import annotations

import functools
import random
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

import goose
from goose.compose import CompositionWarning
from goose.errors import DraftSourceError, GooseError
from goose.interfaces import DraftSource, DraftState, Options, Proposal, check_proposal, check_successors
from goose.sampling import Sampling, build_processors
from goose.testing.toy import MOD, ToyCausalLM, _hash, _weight, reference_greedy, reference_next, reference_sample
from goose.tree import DraftTree

try:  # hypothesis is a test dependency, not a runtime one
    from hypothesis import example, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    example = given = settings = st = None


def random_tree_nodes(rng: random.Random, max_nodes: int, vocab_size: int, oracle: Callable[[list[int]], int],
                      p_oracle: float, p_chain: float = 0.3) -> tuple[list[int], list[int]]:
    """A random tree under a virtual root: (tokens, parents), parent -1 = the root. With probability ``p_oracle`` a
    node carries ``oracle(path)`` (the token the target wants there), so accepted paths of every length occur."""
    tokens: list[int] = []
    parents: list[int] = []
    used: set[tuple[int, int]] = set()
    paths: list[list[int]] = []
    for i in range(rng.randint(0, max_nodes)):
        extend = i and rng.random() < p_chain  # a chain: the last node's child, where the last node was kept
        parent = i - 1 if extend and len(tokens) == i else rng.randint(-1, len(tokens) - 1)
        path = [] if parent < 0 else paths[parent]
        tok = oracle(path) if rng.random() < p_oracle else rng.randrange(vocab_size)
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
    confidence: float = 0.0  # the proposals' confidence, in [0, 1]


class ArbitraryTreeSource(DraftSource):
    """Arbitrary trees from a seeded random stream whose oracle is the toy model's greedy rule, so right and wrong
    tokens mix at every depth. Use it with the ``proposal`` policy, which verifies a proposal as proposed."""

    name = "arbitrary"
    Options = ArbitraryTreeOptions

    def begin(self, request) -> None:
        self.rng = random.Random(self.options.seed)
        self.vocab = request.vocab_size

    def _oracle(self, seq: list[int]) -> Callable[[list[int]], int]:
        return lambda path: reference_next(seq + path, self.vocab)

    def propose(self, state: DraftState) -> Proposal | None:
        o = self.options
        oracle = self._oracle(list(state.tokens))
        toks, pars = random_tree_nodes(self.rng, state.budget - 1, self.vocab, oracle, o.p_oracle, o.p_chain)
        return Proposal(self.name, tuple(toks), tuple(pars), confidence=o.confidence) if toks else None


class ReferenceTreeSource(ArbitraryTreeSource):
    """Random trees whose nodes carry the next token of ``ref_full`` (prompt + expected continuation) with
    probability ``p``, else a random id: checks a model's tree passes against its own decoding."""

    name = "ref-trees"

    def __init__(self, ref_full: Sequence[int], seed: int, p: float, vocab_size: int, p_chain: float = 0.4):
        super().__init__(ArbitraryTreeOptions(seed=seed, p_oracle=p, p_chain=p_chain))
        self.ref, self.vocab_size = list(ref_full), vocab_size

    def begin(self, request) -> None:
        super().begin(request)
        self.vocab = self.vocab_size

    def _oracle(self, seq: list[int]) -> Callable[[list[int]], int]:
        def oracle(path):
            full = seq + path
            if full == self.ref[: len(full)] and len(full) < len(self.ref):
                return self.ref[len(full)]
            return self.rng.randrange(self.vocab)

        return oracle


class ArbitraryChainOptions(Options):
    seed: int = 0
    p_oracle: float = 0.5  # chance that a token is the toy's greedy token after the chain so far
    confidence: float = 0.0  # the proposals' confidence, in [0, 1]
    max_len: int | None = None  # longest chain (None: the step's budget + 4, so policies must cut)


class ArbitraryChainSource(DraftSource):
    """Chains of a seeded random length (0 to ``max_len``) whose tokens are each the toy's greedy token after the
    chain so far with probability ``p_oracle``, else a random id, at confidence ``confidence``."""

    name = "arbitrary-chain"
    Options = ArbitraryChainOptions

    def begin(self, request) -> None:
        self.rng = random.Random(self.options.seed)
        self.vocab = request.vocab_size

    def propose(self, state: DraftState) -> Proposal | None:
        o, rng = self.options, self.rng
        seq, chain = list(state.tokens), []
        for _ in range(rng.randint(0, o.max_len if o.max_len is not None else state.budget + 4)):
            right = rng.random() < o.p_oracle
            chain.append(reference_next(seq + chain, self.vocab) if right else rng.randrange(self.vocab))
        return Proposal.chain(self.name, chain, confidence=o.confidence) if chain else None


class ArbitrarySuccessorOptions(Options):
    seed: int = 0
    p_oracle: float = 0.5  # chance that the toy's greedy token is among a node's successors (where known)
    max_k: int = 4  # most successors per call


class ArbitrarySuccessorSource(DraftSource):
    """A successor source (it never proposes) answering ``successors(token, prev)`` with up to ``max_k`` distinct
    ids, scores in (0, 1], best first: random ids and, with probability ``p_oracle`` at a random rank, the toy's
    greedy token after ``token`` where ``(prev, token)`` lies on the greedy continuation of the committed text
    (followed through ``begin``, ``propose`` and ``observe``)."""

    name = "arbitrary-successors"
    Options = ArbitrarySuccessorOptions
    provides_successors = True

    def begin(self, request) -> None:
        self.rng = random.Random(self.options.seed)
        self.vocab = request.vocab_size
        self.prompt = list(request.prompt_ids)
        self.seq = list(self.prompt)  # the committed text as far as known, the anchor last
        self.line: list[int] | None = None

    def propose(self, state: DraftState) -> Proposal | None:
        if len(state.tokens) != len(self.seq) or list(state.tokens) != self.seq:
            self.seq, self.line = list(state.tokens), None
        return None

    def observe(self, verified) -> None:
        if verified.kind == "prefill" and verified.argmax:  # the greedy first token (a draw may differ)
            self.seq = [*self.prompt, int(verified.argmax[-1])]
        elif verified.kind == "tree" and verified.tree is not None:  # its root is the anchor as committed
            bonus = () if verified.bonus is None else (int(verified.bonus),)
            self.seq = [*self.seq[:-1], verified.tree.tokens[0], *verified.accepted, *bonus]
        self.line = None

    def successors(self, token: int, prev: int | None):
        if self.line is None:
            self.line = self.seq + reference_greedy(self.seq, 40, self.vocab)
        line = self.line
        oracle = next((line[i + 1] for i in range(max(len(self.seq) - 1, 0), len(line) - 1)
                       if line[i] == token and (line[i - 1] == prev if i else prev is None)), None)
        rng = self.rng
        k = min(rng.randint(0, self.options.max_k), self.vocab)
        ids: list[int] = []
        while len(ids) < k:
            t = rng.randrange(self.vocab)
            if t not in ids and t != oracle:
                ids.append(t)
        if oracle is not None and rng.random() < self.options.p_oracle:
            if len(ids) == k and ids:
                ids.pop()
            ids.insert(rng.randint(0, len(ids)), oracle)
        return ids, [1.0 / (r + 1) for r in range(len(ids))]


def echo_prompt(vocab_size: int, max_new_tokens: int, keep: int = 8) -> list[int]:
    """A prompt holding its own greedy continuation on the toy model: at every step of a greedy generation of up
    to ``max_new_tokens``, the last ``keep`` + (tokens generated) committed tokens occurred earlier in it, followed
    by the next token, so a context-match source (n-grams up to ``keep`` + 1 long) finds the right match every step.
    The toy's continuation depends on a prompt only through its length and hash ``h``: a base prompt's last ``keep``
    tokens and continuation are written at its start, and a few tokens after them chosen (meet in the middle) to
    restore h."""
    V = vocab_size
    if V < 2:  # nothing to choose from: a constant prompt (its continuation is constant too)
        return [0] * (keep + 1)
    n = max_new_tokens + keep
    k = 1
    while V**k < 16 * MOD:  # enough value combinations that some hits any residue
        k += 1
    for k in range(k, k + 8):
        length = 2 * keep + n + k
        base = (list(range(V)) * (length // V + 1))[:length]
        cont = reference_greedy(base, n, V)
        memory = base[-keep:] + cont
        prompt = memory + [0] * k + base[len(memory) + k :]
        slots = range(len(memory), len(memory) + k)
        rest = sum((t + 1) * _weight(j) for j, t in enumerate(prompt) if j not in slots)
        target = (_hash(base) - rest) % MOD
        a_slots, b_slots = list(slots)[: k // 2], list(slots)[k // 2 :]

        def sums(js):  # every assignment of ids to slots js (mixed radix, first slot most significant)
            s = np.zeros(1, dtype=np.int64)
            for j in js:
                s = ((s[:, None] + (np.arange(1, V + 1, dtype=np.int64) * _weight(j)) % MOD) % MOD).ravel()
            return s

        a, b = sums(a_slots), sums(b_slots)
        order = np.argsort(a, kind="stable")
        a_sorted = a[order]
        need = (target - b) % MOD
        at = np.minimum(np.searchsorted(a_sorted, need), len(a_sorted) - 1)
        hits = np.nonzero(a_sorted[at] == need)[0]
        if not len(hits):
            continue  # one more slot
        ib = int(hits[0])
        ia = int(order[at[ib]])
        digits = [*np.unravel_index(ia, (V,) * len(a_slots)), *np.unravel_index(ib, (V,) * len(b_slots))]
        prompt[slots.start:slots.stop] = [int(t) for t in digits]
        assert reference_greedy(prompt, n, V) == cont, "echo_prompt: the continuation moved (toy changed?)"
        return prompt
    raise AssertionError(f"echo_prompt found no prompt for vocab_size={V}")  # pragma: no cover


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
        origins = ["root"] + [draw(st.sampled_from(["lead", "branch", "x"])) for _ in tokens[1:]]
        return DraftTree.build(tokens, parents, origins)

else:  # pragma: no cover

    def trees(*a, **k):
        raise ImportError("goose.testing.trees needs hypothesis: pip install hypothesis")


def _proposal_paths(prop) -> list[tuple[int, ...]]:
    """The token paths from the top down to each node of a proposal (or of a tree, its root included)."""
    paths: list[tuple[int, ...]] = []
    for t, p in zip(prop.tokens, prop.parents):
        paths.append((*(paths[p] if 0 <= p < len(paths) else ()), int(t)))
    return paths


class _Drafts:
    """Spies on ``sources``: what each drafted since :meth:`clear` (the token paths of its proposals, the
    successors it gave by parent token), the drafts counted in ``proposals``, the ones failing the boundary
    checks in ``invalid`` and any change to ``state.tokens`` during ``propose`` in ``mutated``."""

    def __init__(self, sources, vocab_size: int):
        self.vocab_size = vocab_size
        self.proposals, self.invalid, self.mutated = 0, [], []
        self.clear()
        for src in sources:
            src.propose = functools.partial(self._propose, src, src.propose)
            if src.provides_successors:
                src.successors = functools.partial(self._successors, src, src.successors)

    def clear(self) -> None:
        self.paths: dict[str, set] = {}
        self.succ: dict[tuple[str, int], set] = {}

    def undrafted(self, tree: DraftTree, names) -> list[tuple[int, str, tuple[int, ...]]]:
        """``(node, source, path)`` for each node of ``tree`` credited to a source in ``names`` that did not draft it
        since :meth:`clear` (neither a path of its proposal nor a successor it gave after the node's parent)."""
        paths = [p[1:] for p in _proposal_paths(tree)]
        return [(i, name, paths[i]) for i in range(1, tree.num_nodes) for name in tree.credited(i)
                if name in names and paths[i] not in self.paths.get(name, ())
                and tree.tokens[i] not in self.succ.get((name, tree.tokens[tree.parents[i]]), ())]

    def _propose(self, src, propose, state):
        before = list(state.tokens)
        prop = propose(state)
        if list(state.tokens) != before:
            self.mutated.append((before, list(state.tokens)))
        if prop is not None:
            self.proposals += 1
            try:
                check_proposal(src.name, prop, self.vocab_size)
            except DraftSourceError as exc:
                self.invalid.append(str(exc))
            else:
                self.paths.setdefault(src.name, set()).update(_proposal_paths(prop))
        return prop

    def _successors(self, src, successors, token, prev):
        ids, scores = successors(token, prev)
        try:  # the loop refuses these as they leave the source; recorded here as a backstop
            if len(ids) or len(scores):
                check_successors(src.name, token, ids, scores, self.vocab_size)
        except DraftSourceError as exc:
            self.invalid.append(str(exc))
        else:
            if len(ids):
                self.proposals += 1
                self.succ.setdefault((src.name, int(token)), set()).update(int(t) for t in ids)
        return ids, scores


class _ToyKit:
    """What the kits share: drawn prompts on the toy model, outputs checked against greedy and seeded sampling.
    A kit's ``_decoder(budget=, eos=, **drawn)`` composes the decoder under test; ``_draws()`` names what else is
    drawn for it; ``_lossless_budgets()`` and ``_later_budgets`` bound the budgets of the checks."""

    vocab_size = 16
    _later_budgets = (16, 16)

    def _draws(self) -> dict:
        return {}

    def _lossless_budgets(self) -> tuple[int, int]:
        return 1, 16

    def _prompt(self, max_size: int):
        return st.lists(st.integers(0, self.vocab_size - 1), min_size=1, max_size=max_size)

    def _generate(self, dec, prompt, max_new: int, **kw):
        return dec.generate(list(prompt), max_new_tokens=max_new, **kw)

    def _check_greedy(self, dec, prompt, max_new: int, eos: int | None):
        out = self._generate(dec, prompt, max_new, do_sample=False)
        ref = reference_greedy(prompt, max_new, self.vocab_size, [] if eos is None else [eos])
        assert out.token_ids == ref, f"diverged: got {out.token_ids}, greedy {ref}"
        return out

    def test_lossless_on_toy(self):
        @settings(max_examples=self.max_examples, deadline=None)
        @given(prompt=self._prompt(30), max_new=st.integers(0, 40), budget=st.integers(*self._lossless_budgets()),
               eos=st.none() | st.integers(0, self.vocab_size - 1), **self._draws())
        def prop(prompt, max_new, budget, eos, **drawn):
            self._check_greedy(self._decoder(budget=budget, eos=eos, **drawn), prompt, max_new, eos)

        prop()

    def test_sampling_is_seed_identical(self):
        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompt=self._prompt(20), max_new=st.integers(8, 30), seed=st.integers(0, 2**16),
               budget=st.integers(*self._later_budgets), temperature=st.sampled_from([0.5, 1.0, 1.5]),
               top_k=st.sampled_from([None, 4]), **self._draws())
        def prop(prompt, max_new, seed, budget, temperature, top_k, **drawn):
            dec = self._decoder(budget=budget, **drawn)
            p = {"do_sample": True, "temperature": temperature, "top_k": top_k}
            out = self._generate(dec, prompt, max_new, generator=torch.Generator().manual_seed(seed), **p)
            procs = build_processors(Sampling(**p), len(prompt), [])
            ref = reference_sample(prompt, max_new, self.vocab_size, procs, torch.Generator().manual_seed(seed))
            assert out.token_ids == ref, f"sampling diverged: got {out.token_ids}, one-token sampling {ref}"

        prop()


class _GenerationsKit(_ToyKit):
    """The source and policy kits: :class:`_ToyKit` and several generations on one decoder."""

    def test_generations_on_one_decoder(self):
        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompts=st.lists(self._prompt(20), min_size=2, max_size=4), max_new=st.integers(8, 30),
               budget=st.integers(*self._later_budgets), **self._draws())  # long enough to draft
        def prop(prompts, max_new, budget, **drawn):
            dec = self._decoder(budget=budget, **drawn)
            for prompt in [*prompts, prompts[0]]:  # the first prompt again, last: what a history would serve
                self._check_greedy(dec, prompt, max_new, None)
            self._check_calls(dec, len(prompts) + 1)

        prop()


class SourceLosslessnessKit(_GenerationsKit):
    """The checks a draft source must pass, as a pytest base class: subclass it in your plugin's tests and
    implement :meth:`make_source`. Each check runs the source on the exact toy model under :attr:`policy` (a
    successor source needs a tree policy such as "spine"). docs/plugins.md lists the tests and the attributes."""

    policy = "proposal"
    policy_options: dict | None = None
    extra_sources: tuple = ()
    max_examples = 30
    require_drafts = True

    def make_source(self) -> DraftSource | str | tuple:  # pragma: no cover - to override
        raise NotImplementedError

    def _decoder(self, budget: int = 16, eos: int | None = None):
        """The source under test composed on the toy, its first source spied on (``dec._kit_spy``)."""
        model = ToyCausalLM(self.vocab_size, eos_token_id=eos, max_positions=4096)
        dec = goose.compose(model, None, sources=[self.make_source(), *self.extra_sources], policy=self.policy,
                            policy_options=self.policy_options, budget=budget)
        first = dec._idle[0].sources[0]
        if first.provides_successors and dec.policy.name == "proposal":
            raise AssertionError(
                f"{first.name!r} is a successor source (provides_successors = True) and the kit's policy "
                f"'proposal' verifies proposals as proposed, never asking for successors: a successor source "
                f"needs a tree policy: set policy = \"spine\" (or \"tr-tree\") on the kit subclass")
        _spy(dec, self.vocab_size)
        return dec

    def _run(self, prompt: Sequence[int], max_new: int, budget: int, eos: int | None, dec=None):
        return self._check_greedy(dec or self._decoder(budget, eos), prompt, max_new, eos)

    def _check_calls(self, dec, n: int) -> None:
        assert dec._kit_spy["ends"] == n, "end() was not called once per generation"

    def test_proposals_are_drafted_and_valid(self):
        dec = self._decoder(12)
        out = self._run(echo_prompt(self.vocab_size, 30), 30, 12, None, dec)
        seen, drafts = dec._kit_spy, dec._kit_spy["drafts"]
        # a backstop: the loop itself refuses these (a DraftSourceError) before they get here
        assert not drafts.mutated, f"state.tokens changed during propose(): {drafts.mutated[:3]}"
        assert not drafts.invalid, f"invalid proposals: {drafts.invalid[:3]}"
        # what the loop does not check: a verified node credited to the source was drafted by it at that step
        name, credited, foreign = seen["name"], seen["credited"], seen["foreign"]
        assert not foreign, f"nodes credited to {name!r} that it never drafted (step, node, path): {foreign[:3]}"
        got = out.stats.per_source.get(name, {}).get("drafted", 0)
        assert got == credited, (
            f"stats.per_source[{name!r}] counts {got} drafted tokens; the verified trees credit it {credited}")
        if self.require_drafts:
            assert drafts.proposals > 0, (
                "the source never proposed on a prompt that holds its own continuation (goose.testing.kit.echo_prompt)"
                " (set require_drafts = False if that is intended)")
            assert credited > 0, (
                f"the source proposed {drafts.proposals} times but no verified tree holds a node credited to {name!r}")


def _spy(dec, vocab_size: int) -> None:
    """Spy on the decoder's first source (``dec._kit_spy``): its drafts (:class:`_Drafts`), its ``end`` calls,
    and the nodes of the verified trees credited to it (``credited``), those it had not drafted that step in
    ``foreign``."""
    src = dec._idle[0].sources[0]
    drafts = _Drafts([src], vocab_size)
    seen = dec._kit_spy = {"name": src.name, "drafts": drafts, "ends": 0, "steps": 0, "credited": 0, "foreign": []}
    observe = src.observe

    def spied_observe(verified):
        tree = verified.tree if verified.kind == "tree" else None
        if tree is not None:  # the drafts since the last tree are this step's
            seen["credited"] += sum(src.name in tree.credited(i) for i in range(1, tree.num_nodes))
            foreign = drafts.undrafted(tree, {src.name})
            seen["foreign"] += [(seen["steps"], tree.label(i), path) for i, _, path in foreign]
            seen["steps"] += 1
            drafts.clear()
        return observe(verified)

    src.observe, src.end = spied_observe, _counted(seen, "ends", src.end)


_KINDS = {"chain": ArbitraryChainSource, "tree": ArbitraryTreeSource, "successors": ArbitrarySuccessorSource}


def _kit_sources(mix) -> list[DraftSource]:
    """The kit's sources for a drawn ``mix``: ``(kind, seed, p_oracle, confidence)`` per source."""
    out = []
    for kind, seed, p, conf in mix:
        extra = {"chain": {"confidence": conf}, "tree": {"p_chain": 0.5, "confidence": conf}}.get(kind, {})
        out.append(_KINDS[kind](_KINDS[kind].Options(seed=seed, p_oracle=p, **extra)))
    return out


class PolicyLosslessnessKit(_GenerationsKit):
    """The checks a tree policy must pass, as a pytest base class: subclass it in your plugin's tests and implement
    :meth:`make_policy`. Every check composes the policy on the exact toy model with a drawn mix of the kit's
    sources (:func:`_kit_sources`), and :func:`_policy_spy` checks every tree ``shape`` returns. docs/plugins.md
    lists the tests and the attributes."""

    policy_options: dict | None = None
    source_kinds: tuple = ("chain", "tree", "successors")
    required_kinds: tuple = ()
    max_budget = 24
    max_examples = 20
    require_drafts = True
    _later_budgets = (2, 16)

    def make_policy(self):  # pragma: no cover - to override
        """The policy under test: a name, ``(name, options)`` or a new instance (one per call)."""
        raise NotImplementedError

    def _draws(self) -> dict:
        return {"mix": self._mix()}

    def _mix(self, confident: bool = False):
        """Hypothesis strategy: a non-empty tuple of ``(kind, seed, p_oracle, confidence)``, one per source."""
        kinds = tuple(dict.fromkeys(self.source_kinds))
        required = tuple(dict.fromkeys(self.required_kinds))
        conf = st.just(1.0) if confident else st.sampled_from([0.0, 0.5, 1.0])

        @st.composite
        def mix(draw):
            order = list(required)
            for k in draw(st.lists(st.sampled_from(kinds), unique=True, min_size=0 if order else 1)):
                if k not in order:
                    order.insert(draw(st.integers(0, len(order))), k)
            return tuple((k, draw(st.integers(0, 2**16)), draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])), draw(conf))
                         for k in order)

        return mix()

    def _decoder(self, mix, budget: int = 16, eos: int | None = None):
        model = ToyCausalLM(self.vocab_size, eos_token_id=eos, max_positions=4096)
        with warnings.catch_warnings():  # a drawn mix may hold a source the policy never consults
            warnings.simplefilter("ignore", CompositionWarning)
            dec = goose.compose(model, None, sources=_kit_sources(mix), policy=self.make_policy(),
                                policy_options=self.policy_options, budget=budget)
        _policy_spy(dec, self.vocab_size)
        return dec

    def _generate(self, dec, prompt, max_new: int, **kw):
        """``dec.generate``, then the spy's findings: a tree the policy returned that breaks a rule is an
        AssertionError naming it (also when the loop refused that tree first)."""
        seen = dec._kit_policy
        try:
            out = super()._generate(dec, prompt, max_new, **kw)
        except GooseError as exc:
            if seen["violations"]:
                raise AssertionError(_violations(seen)) from exc
            raise
        assert not seen["violations"], _violations(seen)
        return out

    def _check_calls(self, dec, n: int) -> None:
        seen = dec._kit_policy
        assert seen["begins"] == n and seen["ends"] == n, (
            f"{n} generations, but the policy's begin() was called {seen['begins']} times and end() {seen['ends']}")

    def test_trees_within_budget_and_valid(self):
        @settings(max_examples=max(1, self.max_examples // 2), deadline=None)
        @given(prompt=self._prompt(20), max_new=st.integers(16, 48), budget=st.integers(1, self.max_budget),
               mix=self._mix(confident=True) | self._mix())
        def prop(prompt, max_new, budget, mix):
            dec = self._decoder(mix, budget)
            self._check_greedy(dec, prompt, max_new, None)
            assert dec._kit_policy["shaped"] > 0 or max_new < 2, "the policy's shape() was never called"

        prop()

    def test_drafts_from_right_sources(self):
        kinds = tuple(dict.fromkeys((*self.required_kinds, *self.source_kinds)))
        for conf in (1.0, 0.0):
            dec = self._decoder(tuple((k, 7, 1.0, conf) for k in kinds), 12)
            for _ in range(2):  # a policy that learns acceptance may start cautious
                out = self._check_greedy(dec, echo_prompt(self.vocab_size, 40), 40, None)
            if not self.require_drafts:
                return
            seen = dec._kit_policy
            assert seen["drafted"] > 0, (
                f"with sources that are always right ({', '.join(kinds)}, confidence {conf}) the policy never "
                f"returned a tree of more than the anchor in {seen['shaped']} steps (set require_drafts = False "
                "if that is intended)")
            assert out.stats.forward_passes < 40, (
                f"with sources that are always right the policy took {out.stats.forward_passes} forwards for 40 tokens")


def _violations(seen) -> str:
    v = seen["violations"]
    return (f"tree policy {seen['policy']!r} returned trees that break the rules ({len(v)} findings); first: "
            + "; ".join(v[:3]))


def _policy_spy(dec, vocab_size: int) -> None:
    """Check, on ``dec._kit_policy``, every tree the decoder's policy returns as it leaves ``shape`` (see
    :class:`PolicyLosslessnessKit`) against what the sources drafted in that step, and count ``begin`` / ``end``."""
    worker = dec._idle[0]
    policy = worker.policy
    names = {s.name for s in worker.sources}
    drafts = _Drafts(worker.sources, vocab_size)
    seen = {"policy": policy.name, "violations": [], "shaped": 0, "drafted": 0, "begins": 0, "ends": 0}
    dec._kit_policy = seen
    shape = policy.shape

    def spied_shape(ctx):
        drafts.clear()
        tree = shape(ctx)
        seen["shaped"] += 1
        bad = seen["violations"]
        where = f"step {ctx.state.step} (anchor {ctx.state.anchor}, budget {ctx.budget})"
        if tree is None:
            return tree
        if not isinstance(tree, DraftTree):
            bad.append(f"{where}: shape() returned {type(tree).__name__}, not a DraftTree or None")
            return tree
        if tree.num_nodes > 1:
            seen["drafted"] += 1
        limit = policy.max_nodes(ctx.budget)
        if tree.num_nodes > limit:
            bad.append(f"{where}: a tree of {tree.num_nodes} nodes, over policy.max_nodes({ctx.budget}) = {limit}")
        if tree.num_nodes > 1 and tree.tokens[0] != ctx.state.anchor:
            bad.append(f"{where}: the tree's root is token {tree.tokens[0]}, not the anchor {ctx.state.anchor}")
        out_of_vocab = [t for t in tree.tokens if t >= vocab_size]
        if out_of_vocab:
            bad.append(f"{where}: token ids {out_of_vocab[:3]} outside the vocabulary [0, {vocab_size})")
        if tree.sources is not None:
            bad += [f"{where}: node {i} is credited to {name!r}, not a composed source ({sorted(names)})"
                    for i in range(1, tree.num_nodes) for name in tree.sources[i] if name not in names]
            bad += [f"{where}: node {i} (path {path}) is credited to {name!r}, which did not draft it this step "
                    "(neither a path of its proposal nor a successor it gave)"
                    for i, name, path in drafts.undrafted(tree, names)]
        return tree

    policy.shape = spied_shape
    policy.begin = _counted(seen, "begins", policy.begin)
    policy.end = _counted(seen, "ends", policy.end)


def _counted(seen: dict, key: str, fn: Callable) -> Callable:
    """``fn``, counting its calls in ``seen[key]``."""
    def counted(*args):
        seen[key] += 1
        return fn(*args)

    return counted
