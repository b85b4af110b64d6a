"""The losslessness test kit for verifiers: a pytest base class that checks a verifier's passes and output on
Goose's exact toy model, where every logit row is known without a forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from goose.interfaces import DraftSource, Options, Verified, Verifier
from goose.sampling import Sampling, build_processors
from goose.testing.kit import ArbitraryTreeSource
from goose.testing.toy import reference_greedy, reference_logits, reference_next


class PrefillRowsOptions(Options):
    rows: int = 1  # trailing prompt positions whose logits the source asks the prefill for


class PrefillRowsSource(DraftSource):
    """A source that drafts nothing and asks the prefill for ``rows`` trailing prompt positions' logits
    (``prefill_positions``), recording every prefill record it observes: what the verifier kit checks the
    deferred rows against."""

    name = "prefill-rows"
    Options = PrefillRowsOptions

    def __init__(self, options: PrefillRowsOptions | None = None):
        super().__init__(options)
        self.seen: list[Verified] = []

    def prefill_positions(self, prompt_len: int) -> int:
        return self.options.rows

    def propose(self, state):
        return None

    def observe(self, verified: Verified) -> None:
        if verified.kind == "prefill":
            self.seen.append(verified)


def _rows_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.equal(got.detach().to(torch.float32).cpu(), want)


class VerifierLosslessnessKit:
    """The checks a verifier must pass, as a pytest base class: subclass it in your plugin's tests and
    implement :meth:`make_verifier`. Every check composes your verifier on Goose's exact toy model
    (``goose.testing.ToySplitLM``: each position's logits are a known integer function of what it may attend
    to, so a mask, position or cache fault changes them) with :class:`~goose.testing.ArbitraryTreeSource`
    (trees of every shape mixing the toy's greedy tokens and wrong ones, verified as proposed by the
    ``proposal`` policy) and :class:`PrefillRowsSource` (asks the prefill for drawn trailing rows):

    - ``test_lossless_on_toy``: output identical to greedy decoding (``reference_greedy``) for drawn prompts,
      lengths, budgets, stop tokens and trees;
    - ``test_passes_are_exact``: every pass the verifier returns, checked as it leaves it: a ``Verified``
      with one logit row per token; the prefill's rows are the prompt's last ``keep`` positions (or the last
      one, with ``rest`` set), each row the toy's logits there, ``bonus`` the greedy first token; a tree
      pass has one row per node, ``tokens`` the tree's, ``predecessors`` the parents' tokens, each row the
      toy's logits after the node's path, ``argmax`` its greedy token, ``path`` / ``accepted`` / ``bonus``
      the greedy walk (the longest path whose every node is the greedy token after its parent);
    - ``test_deferred_prefill_rows``: a source asking for k trailing rows observes the prefill once, with
      min(k, prompt length) rows, each the toy's (also when the generation ends at its first token, where
      the last row is enough);
    - ``test_end_once_per_generation``: ``end`` once per ``generate``, also when a generation raises
      (a source that fails mid-way), and the decoder's next generations identical to greedy (nothing left
      in the cache);
    - ``test_sampling_is_seed_identical``: with ``supports_rules``, sampling (temperature, top-k) with a
      seeded generator draws what one-token sampling of the toy draws; without it, a sampling request is
      refused with an ``InvalidInputError`` naming the verifier;
    - ``test_speed_protocol``: the verifier's speed protocol (``timing_key``, ``pass_forms``, ``form_serves``,
      ``time_pass``, ``forms_kept``) calibrates it (``goose.verifiers.latency.measure``: positive times at every size,
      each form only where it serves, a JSON key), and its output after the calibration is still greedy's.

    Attributes a subclass may set: ``vocab_size`` (16), ``max_examples`` (20: Hypothesis examples per
    property, a third for the slower ones), ``max_budget`` (24: the largest tree drawn), and
    :meth:`make_model` (default ``ToySplitLM(vocab_size, eos_token_id=eos, max_positions=4096)``: the toy
    built as transformers' causal LMs are, a decoder and an LM head applied apart, so that a verifier can
    defer the prefill's rows as the built-in one does on real models; ``ToyCausalLM`` for one that cannot).
    """

    vocab_size = 16
    max_examples = 20
    max_budget = 24

    def make_verifier(self):  # pragma: no cover - to override
        """The verifier under test: a name, ``(name, options)`` or a new instance (one per call)."""
        raise NotImplementedError

    def make_model(self, eos: int | None = None):
        from goose.testing.toy import ToySplitLM

        return ToySplitLM(self.vocab_size, eos_token_id=eos, max_positions=4096)

    # -- building and running ---------------------------------------------------------------------
    def _decoder(self, seed: int, budget: int, eos: int | None = None, rows: int = 1, p_oracle: float = 0.6,
                 fail_at: int | None = None):
        import goose

        trees = ArbitraryTreeSource(ArbitraryTreeSource.Options(seed=seed, p_oracle=p_oracle, p_chain=0.5))
        # the proposal policy verifies the first source's proposal: the failing one is asked first (it
        # proposes nothing until armed), the recorder last
        sources: list = [trees, PrefillRowsSource(PrefillRowsOptions(rows=rows))]
        if fail_at is not None:
            sources.insert(0, _FailingSource(fail_at))
        spy = _Spy(_built(self.make_verifier()), self.vocab_size)
        dec = goose.compose(self.make_model(eos), None, sources=sources, policy="proposal", verifier=spy, budget=budget)
        return _Kit(dec, spy.seen, {s.name: s for s in sources})

    def _run(self, kit, prompt: Sequence[int], max_new: int, eos: int | None = None):
        out = kit.dec.generate(list(prompt), max_new_tokens=max_new, do_sample=False)
        _raise_findings(kit.seen)
        ref = reference_greedy(prompt, max_new, self.vocab_size, [] if eos is None else [eos])
        assert out.token_ids == ref, f"diverged: got {out.token_ids}, greedy {ref}"
        return out

    # -- the checks --------------------------------------------------------------------------------
    def test_lossless_on_toy(self):
        from hypothesis import given, settings
        from hypothesis import strategies as hs

        @settings(max_examples=self.max_examples, deadline=None)
        @given(prompt=hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=30),
               max_new=hs.integers(0, 40), budget=hs.integers(1, self.max_budget),
               eos=hs.none() | hs.integers(0, self.vocab_size - 1), seed=hs.integers(0, 2**16))
        def prop(prompt, max_new, budget, eos, seed):
            self._run(self._decoder(seed, budget, eos), prompt, max_new, eos)

        prop()

    def test_passes_are_exact(self):
        from hypothesis import given, settings
        from hypothesis import strategies as hs

        @settings(max_examples=self.max_examples, deadline=None)
        @given(prompt=hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=30),
               max_new=hs.integers(2, 40), budget=hs.integers(2, self.max_budget), seed=hs.integers(0, 2**16),
               rows=hs.integers(1, 40), p_oracle=hs.sampled_from([0.3, 0.7, 1.0]))
        def prop(prompt, max_new, budget, seed, rows, p_oracle):
            dec = self._decoder(seed, budget, rows=rows, p_oracle=p_oracle)
            self._run(dec, prompt, max_new)
            seen = dec.seen
            assert seen["prefills"] == 1, f"prefill() was called {seen['prefills']} times for one generation"
            assert seen["verified"] > 0, "verify() was never called"

        prop()

    def test_deferred_prefill_rows(self):
        from hypothesis import given, settings
        from hypothesis import strategies as hs

        @settings(max_examples=max(1, self.max_examples // 2), deadline=None)
        @given(prompt=hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=30),
               max_new=hs.sampled_from([1, 2, 12]), rows=hs.integers(1, 40), seed=hs.integers(0, 2**16))
        def prop(prompt, max_new, rows, seed):
            dec = self._decoder(seed, 8, rows=rows)
            self._run(dec, prompt, max_new)
            recorder = dec.sources[PrefillRowsSource.name]
            assert len(recorder.seen) == 1, f"the prefill was observed {len(recorder.seen)} times"
            v = recorder.seen[0]
            want = min(rows, len(prompt))
            n = int(v.tokens.shape[0])
            if max_new == 1 and n == 1:
                want = 1  # ended at its first token: the deferred rows were never needed
            assert n == want, (
                f"a source asked for {rows} prefill rows of a {len(prompt)}-token prompt and observed {n} "
                f"(want {want}); a deferred prefill's Verified.rest must return every row the loop asked for")
            assert v.rest is None, "the sources observed a prefill record that still defers its rows"
            _check_prefill_rows(list(prompt), v, self.vocab_size)

        prop()

    def test_end_once_per_generation(self):
        import goose

        from hypothesis import given, settings
        from hypothesis import strategies as hs

        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompts=hs.lists(hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=20),
                                min_size=2, max_size=4),
               max_new=hs.integers(20, 30), seed=hs.integers(0, 2**16), fail_at=hs.integers(1, 6))
        def prop(prompts, max_new, seed, fail_at):  # a 12-node budget: the failing step comes before the end
            dec = self._decoder(seed, 12, fail_at=fail_at)
            failing = dec.sources[_FailingSource.name]
            failing.armed = True
            try:
                dec.dec.generate(list(prompts[0]), max_new_tokens=max_new, do_sample=False)
            except goose.DraftSourceError:
                pass
            else:
                raise AssertionError("the failing source's error did not reach generate()")
            seen = dec.seen
            assert seen["ends"] == 1, f"a generation that raised called end() {seen['ends']} times"
            failing.armed = False
            for i, prompt in enumerate(prompts, start=2):
                self._run(dec, prompt, max_new)
                assert seen["ends"] == i, f"{i} generations, end() called {seen['ends']} times"

        prop()

    def test_sampling_is_seed_identical(self):
        import goose
        import pytest

        from hypothesis import given, settings
        from hypothesis import strategies as hs

        from goose.testing.toy import reference_sample

        probe = self._decoder(0, 8)
        if not probe.dec.verifier.supports_rules:
            with pytest.raises(goose.InvalidInputError, match=repr(probe.dec.verifier.name)):
                probe.dec.generate([1, 2, 3], max_new_tokens=4, do_sample=True, seed=0)
            return

        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompt=hs.lists(hs.integers(0, self.vocab_size - 1), min_size=1, max_size=20),
               max_new=hs.integers(8, 30), seed=hs.integers(0, 2**16), budget=hs.integers(2, 16),
               temperature=hs.sampled_from([0.5, 1.0, 1.5]), top_k=hs.sampled_from([None, 4]))
        def prop(prompt, max_new, seed, budget, temperature, top_k):
            dec = self._decoder(seed, budget)
            p = {"do_sample": True, "temperature": temperature, "top_k": top_k}
            out = dec.dec.generate(prompt, max_new_tokens=max_new, generator=torch.Generator().manual_seed(seed), **p)
            procs = build_processors(Sampling(**p), len(prompt), [])
            ref = reference_sample(prompt, max_new, self.vocab_size, procs, torch.Generator().manual_seed(seed))
            assert out.token_ids == ref, f"sampling diverged: got {out.token_ids}, one-token sampling {ref}"

        prop()


    def test_speed_protocol(self):
        import json

        from goose.verifiers import latency
        from goose.tree import DraftTree

        kit = self._decoder(0, 8)
        ver = kit.dec.verifier
        key = ver.timing_key()
        assert isinstance(key, dict) and json.loads(json.dumps(key)) == key, f"timing_key() {key!r} is not a JSON dict"
        forms = tuple(ver.pass_forms())
        assert all(isinstance(f, str) and f for f in forms), f"pass_forms() {forms!r}: names, as str"
        ver.prefill(torch.tensor([1, 2, 3, 4]), 1)
        for n in (1, 2, 5):
            chain = DraftTree.from_chain(1, [2] * (n - 1), "x")
            for form in (None, *(f for f in forms if ver.form_serves(f, n))):
                dt = ver.time_pass(chain, form)
                assert isinstance(dt, float) and dt > 0, f"time_pass(<{n} nodes>, {form!r}) returned {dt!r}"
        ver.end()
        curve = latency.measure(kit.dec.model, ver, sizes=(1, 2, 4, 8), past_len=16, repeats=1, budget_s=5.0,
                                measure_head=False)
        assert curve.sizes[0] == 1 and all(t > 0 for t in curve.seconds), f"the calibration measured {curve}"
        for form, ns in curve.forms:
            assert form in forms and all(ver.form_serves(form, n) for n in ns), (
                f"the calibration listed form {form!r} at sizes {list(ns)}: not a pass form serving them")
        self._run(kit, [1, 2, 3, 1, 2], 12)  # the verifier still decodes greedily after its calibration


class _FailingSource(DraftSource):
    """Raises in ``propose`` once ``at`` tokens are generated, while ``armed``: a generation that fails mid-way."""

    name = "kit-failing"

    def __init__(self, at: int):
        super().__init__()
        self.at, self.armed = at, False

    def propose(self, state):
        if self.armed and len(state.tokens) - state.prompt_len >= self.at:
            raise RuntimeError("the verifier kit's source fails mid-generation")
        return None


class _Kit:
    """A kit's decoder (``dec``), its spy's record (``seen``) and the sources it composed, by name."""

    def __init__(self, dec, seen: dict, sources: dict):
        self.dec, self.seen, self.sources = dec, seen, sources


def _built(spec) -> Verifier:
    from goose.manager import build_component

    return build_component("verifier", spec, Verifier, None)


def _check_prefill_rows(prompt: list[int], v: Verified, vocab: int) -> None:
    """The prefill record's rows are the prompt's last positions, each the toy's logits there (asserted)."""
    n = int(v.tokens.shape[0])
    assert int(v.logits.shape[0]) == n, f"the prefill record has {int(v.logits.shape[0])} logit rows for {n} tokens"
    assert 1 <= n <= len(prompt), f"the prefill record covers {n} positions of a {len(prompt)}-token prompt"
    start = len(prompt) - n
    assert v.tokens.tolist() == prompt[start:], (
        f"the prefill record's tokens {v.tokens.tolist()} are not the prompt's last {n} {prompt[start:]}")
    want_pred = [prompt[j - 1] if j > 0 else -1 for j in range(start, len(prompt))]
    assert v.predecessors.tolist() == want_pred, (
        f"the prefill record's predecessors {v.predecessors.tolist()} are not the tokens before them {want_pred}")
    for r, j in enumerate(range(start, len(prompt))):
        want = reference_logits(prompt[: j + 1], vocab)
        assert _rows_equal(v.logits[r : r + 1], want), (
            f"prefill logit row {r} (prompt position {j}) is not the model's: got {v.logits[r].tolist()}, "
            f"want {want[0].tolist()}")


def _check_tree_pass(ctx: list[int], tree, v: Verified, vocab: int) -> None:
    """A tree pass against the toy's logits and the greedy walk, from the committed text ``ctx`` (asserted)."""
    n = tree.num_nodes
    assert v.kind == "tree", f"verify() returned a {v.kind!r} record"
    assert int(v.logits.shape[0]) == n and int(v.tokens.shape[0]) == n, (
        f"verify() of a {n}-node tree returned {int(v.tokens.shape[0])} tokens and {int(v.logits.shape[0])} rows")
    assert v.tokens.tolist() == list(tree.tokens), "the pass's tokens are not the tree's"
    assert tree.tokens[0] == ctx[-1], f"the tree's root {tree.tokens[0]} is not the last committed token {ctx[-1]}"
    paths: list[list[int]] = []
    want_argmax = []
    for i in range(n):
        p = tree.parents[i]
        paths.append([] if p < 0 else paths[p] + [tree.tokens[i]])
        want = reference_logits(ctx + paths[i], vocab)
        assert _rows_equal(v.logits[i : i + 1], want), (
            f"tree node {i} (path {paths[i]}): its logit row is not the model's after that path: got "
            f"{v.logits[i].tolist()}, want {want[0].tolist()} (a mask, position or cache fault)")
        want_argmax.append(reference_next(ctx + paths[i], vocab))
    assert tuple(v.argmax) == tuple(want_argmax), f"argmax {v.argmax} is not the model's {want_argmax}"
    if n > 1:
        want_pred = [-1 if p < 0 else tree.tokens[p] for p in tree.parents]
        got = v.predecessors.tolist()
        assert got[1:] == want_pred[1:], f"the pass's predecessors {got} are not the parents' tokens {want_pred}"
    path, node = [0], 0
    while True:
        nxt = [c for c in range(n) if tree.parents[c] == node and tree.tokens[c] == want_argmax[node]]
        if not nxt:
            break
        node = nxt[0]
        path.append(node)
    assert tuple(v.path) == tuple(path), f"the walk's path {v.path} is not the greedy walk's {tuple(path)}"
    accepted = tuple(tree.tokens[i] for i in path[1:])
    assert tuple(v.accepted) == accepted, f"accepted {v.accepted} is not the greedy walk's {accepted}"
    assert v.bonus == want_argmax[path[-1]], f"bonus {v.bonus} is not the greedy token {want_argmax[path[-1]]}"


def _raise_findings(seen: dict) -> None:
    if seen["findings"]:
        raise AssertionError(f"verifier {seen['verifier']!r}: " + seen["findings"][0])


class _Spy(Verifier):
    """The verifier under test, wrapped: every pass it returns is checked as it leaves it (see
    :class:`VerifierLosslessnessKit`), following the committed text from the passes themselves, and its
    ``prefill``, ``verify`` and ``end`` calls are counted in ``seen``. A finding is kept (the first one is
    raised after ``generate``). Everything else, the speed protocol included, is the inner verifier's."""

    def __init__(self, inner: Verifier, vocab: int):
        super().__init__(inner.options)
        self.inner, self.vocab = inner, vocab
        self.name, self.supports_rules = inner.name, inner.supports_rules
        self.seen = {"verifier": inner.name, "prefills": 0, "verified": 0, "ends": 0, "findings": [], "ctx": []}

    def bind(self, model) -> None:
        self.inner.bind(model)
        self.vocab_size, self.max_positions = self.inner.vocab_size, self.inner.max_positions

    def check_request(self, prompt_len: int, max_new_tokens: int, max_depth: int) -> None:
        self.inner.check_request(prompt_len, max_new_tokens, max_depth)

    def _check(self, fn, *args) -> None:
        try:
            fn(*args)
        except AssertionError as exc:
            self.seen["findings"].append(str(exc))

    def prefill(self, prompt_ids, keep=None, rule=None):
        seen, vocab, check = self.seen, self.vocab, self._check
        seen["prefills"] += 1
        v = self.inner.prefill(prompt_ids, keep) if rule is None else self.inner.prefill(prompt_ids, keep, rule=rule)
        prompt = [int(t) for t in prompt_ids.tolist()]
        if isinstance(v, Verified):
            check(_check_prefill_rows, prompt, v, vocab)
            if v.bonus != reference_next(prompt, vocab) and rule is None:
                seen["findings"].append(f"the prefill's bonus {v.bonus} is not the greedy first token "
                                        f"{reference_next(prompt, vocab)}")
            if v.rest is not None and keep is not None and keep > 1:
                inner_rest = v.rest

                def checked_rest():
                    full = inner_rest()
                    if full is not None:
                        check(_check_prefill_rows, prompt, full, vocab)
                        if int(full.tokens.shape[0]) != min(keep, len(prompt)):
                            seen["findings"].append(
                                f"the deferred prefill rows cover {int(full.tokens.shape[0])} positions; the loop "
                                f"asked for keep={keep} of a {len(prompt)}-token prompt")
                    return full

                from dataclasses import replace

                v = replace(v, rest=checked_rest)
            elif v.rest is None and keep is not None and int(v.tokens.shape[0]) != min(keep, len(prompt)):
                seen["findings"].append(f"prefill(keep={keep}) returned {int(v.tokens.shape[0])} rows and no "
                                        "deferred rest; it must return the last keep positions' rows")
        seen["ctx"] = prompt + ([int(v.bonus)] if isinstance(v, Verified) and v.bonus is not None else [])
        return v

    def verify(self, tree, rule=None):
        seen = self.seen
        v = self.inner.verify(tree) if rule is None else self.inner.verify(tree, rule=rule)
        seen["verified"] += 1
        if isinstance(v, Verified) and rule is None:
            self._check(_check_tree_pass, list(seen["ctx"]), tree, v, self.vocab)
            seen["ctx"] = seen["ctx"] + [int(t) for t in v.accepted] + ([int(v.bonus)] if v.bonus is not None else [])
        return v

    def end(self) -> None:
        self.seen["ends"] += 1
        self.inner.end()

    def stats(self) -> dict:
        return self.inner.stats()

    def timing_key(self) -> dict:
        return self.inner.timing_key()

    def pass_forms(self) -> tuple[str, ...]:
        return self.inner.pass_forms()

    def form_serves(self, form: str, rows: int) -> bool:
        return self.inner.form_serves(form, rows)

    def time_pass(self, tree, form=None) -> float:
        return self.inner.time_pass(tree, form)

    def forms_kept(self, forms: frozenset[str]) -> None:
        self.inner.forms_kept(forms)
