"""The losslessness test kit for verifiers: a pytest base class that checks a verifier's passes and output on
Goose's exact toy model, where every logit row is known without a forward pass."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from types import SimpleNamespace

import torch

import goose
from goose.interfaces import DraftSource, Options, Verified, Verifier
from goose.manager import build_component
from goose.testing.kit import ArbitraryTreeSource, _proposal_paths, _ToyKit, example, given, settings, st
from goose.testing.toy import ToySplitLM, reference_logits, reference_next
from goose.tree import DraftTree
from goose.verifiers import latency


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


class VerifierLosslessnessKit(_ToyKit):
    """The checks a verifier must pass, as a pytest base class: subclass it in your plugin's tests and implement
    :meth:`make_verifier`. Every check composes the verifier on :class:`~goose.testing.ToySplitLM` with
    :class:`~goose.testing.ArbitraryTreeSource` under the ``proposal`` policy and :class:`PrefillRowsSource`, and
    checks every pass as it leaves the verifier. docs/plugins.md lists the tests and the attributes."""

    max_examples = 20
    max_budget = 24
    _later_budgets = (2, 16)

    def make_verifier(self):  # pragma: no cover - to override
        """The verifier under test: a name, ``(name, options)`` or a new instance (one per call)."""
        raise NotImplementedError

    def make_model(self, eos: int | None = None):
        """The model under test (``ToyCausalLM`` for a verifier that cannot apply the LM head apart)."""
        return ToySplitLM(self.vocab_size, eos_token_id=eos, max_positions=4096)

    def _draws(self) -> dict:
        return {"tree_seed": st.integers(0, 2**16)}

    def _lossless_budgets(self) -> tuple[int, int]:
        return 1, self.max_budget

    def _decoder(self, tree_seed: int = 0, budget: int = 8, eos: int | None = None, rows: int = 1,
                 p_oracle: float = 0.6, fail_at: int | None = None) -> SimpleNamespace:
        """The verifier under test, spied on, composed on the toy: ``dec`` the decoder, ``seen`` the spy's record,
        ``sources`` the sources by name."""
        trees = ArbitraryTreeSource(ArbitraryTreeSource.Options(seed=tree_seed, p_oracle=p_oracle, p_chain=0.5))
        # the proposal policy verifies the first source's proposal: the failing one is asked first (it
        # proposes nothing until armed), the recorder last
        sources: list = [trees, PrefillRowsSource(PrefillRowsOptions(rows=rows))]
        if fail_at is not None:
            sources.insert(0, _FailingSource(fail_at))
        spy = _Spy(build_component("verifier", self.make_verifier(), Verifier, None), self.vocab_size)
        dec = goose.compose(self.make_model(eos), None, sources=sources, policy="proposal", verifier=spy, budget=budget)
        return SimpleNamespace(dec=dec, seen=spy.seen, sources={s.name: s for s in sources})

    def _generate(self, kit, prompt, max_new: int, **kw):
        out = kit.dec.generate(list(prompt), max_new_tokens=max_new, **kw)
        if kit.seen["findings"]:
            raise AssertionError(f"verifier {kit.seen['verifier']!r}: " + kit.seen["findings"][0])
        return out

    def test_passes_are_exact(self):
        @settings(max_examples=self.max_examples, deadline=None)
        @given(prompt=self._prompt(30), max_new=st.integers(2, 40), budget=st.integers(2, self.max_budget),
               seed=st.integers(0, 2**16), rows=st.integers(1, 40), p_oracle=st.sampled_from([0.3, 0.7, 1.0]))
        def prop(prompt, max_new, budget, seed, rows, p_oracle):
            kit = self._decoder(seed, budget, rows=rows, p_oracle=p_oracle)
            self._check_greedy(kit, prompt, max_new, None)
            assert kit.seen["prefills"] == 1, f"prefill() was called {kit.seen['prefills']} times for one generation"
            assert kit.seen["verified"] > 0, "verify() was never called"

        prop()

    def test_deferred_prefill_rows(self):
        @settings(max_examples=max(1, self.max_examples // 2), deadline=None)
        @given(prompt=self._prompt(30), max_new=st.sampled_from([1, 2, 12]), rows=st.integers(1, 40),
               seed=st.integers(0, 2**16))
        def prop(prompt, max_new, rows, seed):
            kit = self._decoder(seed, 8, rows=rows)
            self._check_greedy(kit, prompt, max_new, None)
            recorder = kit.sources[PrefillRowsSource.name]
            assert len(recorder.seen) == 1, f"the prefill was observed {len(recorder.seen)} times"
            v = recorder.seen[0]
            n = int(v.tokens.shape[0])
            # ended at its first token (max_new 1, one row): the deferred rows were never needed
            want = 1 if max_new == 1 and n == 1 else min(rows, len(prompt))
            assert n == want, (
                f"a source asked for {rows} prefill rows of a {len(prompt)}-token prompt and observed {n} "
                f"(want {want}); a deferred prefill's Verified.rest must return every row the loop asked for")
            assert v.rest is None, "the sources observed a prefill record that still defers its rows"
            _check_prefill_rows(list(prompt), v, self.vocab_size)

        prop()

    def test_end_once_per_generation(self):
        @settings(max_examples=max(1, self.max_examples // 3), deadline=None)
        @given(prompts=st.lists(self._prompt(20), min_size=2, max_size=4), max_new=st.integers(20, 30),
               seed=st.integers(0, 2**16), fail_at=st.integers(1, 6))
        def prop(prompts, max_new, seed, fail_at):  # a 12-node budget: the failing step comes before the end
            kit = self._decoder(seed, 12, fail_at=fail_at)
            failing = kit.sources[_FailingSource.name]
            failing.armed = True
            try:
                kit.dec.generate(list(prompts[0]), max_new_tokens=max_new, do_sample=False)
            except goose.DraftSourceError:
                pass
            else:
                raise AssertionError("the failing source's error did not reach generate()")
            assert kit.seen["ends"] == 1, f"a generation that raised called end() {kit.seen['ends']} times"
            failing.armed = False
            for i, prompt in enumerate(prompts, start=2):
                self._check_greedy(kit, prompt, max_new, None)
                assert kit.seen["ends"] == i, f"{i} generations, end() called {kit.seen['ends']} times"

        prop()

    def test_sampling_is_seed_identical(self):
        import pytest

        probe = self._decoder().dec
        if not probe.verifier.supports_rules:
            with pytest.raises(goose.InvalidInputError, match=repr(probe.verifier.name)):
                probe.generate([1, 2, 3], max_new_tokens=4, do_sample=True, seed=0)
            return
        super().test_sampling_is_seed_identical()

    def test_speed_protocol(self):
        kit = self._decoder()
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
        self._check_greedy(kit, [1, 2, 3, 1, 2], 12, None)  # the verifier still decodes greedily after its calibration


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


def _check_prefill(prompt: list[int], v: Verified, vocab: int, keep: int | None, greedy: bool) -> None:
    """A prefill record: its rows (:func:`_check_prefill_rows`), where ``greedy`` its bonus, and without a deferred
    ``rest`` the last ``keep`` positions' rows (asserted)."""
    _check_prefill_rows(prompt, v, vocab)
    want = reference_next(prompt, vocab)
    assert v.bonus == want or not greedy, f"the prefill's bonus {v.bonus} is not the greedy first token {want}"
    n = int(v.tokens.shape[0])
    assert v.rest is not None or keep is None or n == min(keep, len(prompt)), (
        f"prefill(keep={keep}) returned {n} rows and no deferred rest; it must return the last keep positions' rows")


def _check_prefill_rows(prompt: list[int], v: Verified, vocab: int, keep: int | None = None) -> None:
    """The prefill record's rows are the prompt's last positions, each the toy's logits there; with ``keep``
    (a deferred ``rest``'s record), the last ``keep`` of them (asserted)."""
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
    assert keep is None or n == min(keep, len(prompt)), (
        f"the deferred prefill rows cover {n} positions; the loop asked for keep={keep} of a {len(prompt)}-token "
        "prompt")


def _check_tree_pass(ctx: list[int], tree, v: Verified, vocab: int) -> None:
    """A tree pass against the toy's logits and the greedy walk, from the committed text ``ctx`` (asserted)."""
    n = tree.num_nodes
    assert v.kind == "tree", f"verify() returned a {v.kind!r} record"
    assert int(v.logits.shape[0]) == n and int(v.tokens.shape[0]) == n, (
        f"verify() of a {n}-node tree returned {int(v.tokens.shape[0])} tokens and {int(v.logits.shape[0])} rows")
    assert v.tokens.tolist() == list(tree.tokens), "the pass's tokens are not the tree's"
    assert tree.tokens[0] == ctx[-1], f"the tree's root {tree.tokens[0]} is not the last committed token {ctx[-1]}"
    paths = [list(p[1:]) for p in _proposal_paths(tree)]
    want_argmax = []
    for i in range(n):
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
    path = [0]
    while nxt := [c for c in tree.children[path[-1]] if tree.tokens[c] == want_argmax[path[-1]]]:
        path.append(nxt[0])
    assert tuple(v.path) == tuple(path), f"the walk's path {v.path} is not the greedy walk's {tuple(path)}"
    accepted = tuple(tree.tokens[i] for i in path[1:])
    assert tuple(v.accepted) == accepted, f"accepted {v.accepted} is not the greedy walk's {accepted}"
    assert v.bonus == want_argmax[path[-1]], f"bonus {v.bonus} is not the greedy token {want_argmax[path[-1]]}"


def _inner(name: str):
    """A method that calls the inner verifier's ``name``."""
    return lambda self, *args: getattr(self.inner, name)(*args)


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

    def _check(self, fn, *args) -> None:
        try:
            fn(*args)
        except AssertionError as exc:
            self.seen["findings"].append(str(exc))

    def prefill(self, prompt_ids, keep=None, rule=None):
        self.seen["prefills"] += 1
        v = self.inner.prefill(prompt_ids, keep) if rule is None else self.inner.prefill(prompt_ids, keep, rule=rule)
        prompt = [int(t) for t in prompt_ids.tolist()]
        if isinstance(v, Verified):
            self._check(_check_prefill, prompt, v, self.vocab, keep, rule is None)
            if v.rest is not None and keep is not None and keep > 1:
                v = replace(v, rest=functools.partial(self._checked_rest, v.rest, prompt, keep))
        self.seen["ctx"] = prompt + ([int(v.bonus)] if isinstance(v, Verified) and v.bonus is not None else [])
        return v

    def _checked_rest(self, rest, prompt: list[int], keep: int) -> Verified | None:
        full = rest()
        if full is not None:
            self._check(_check_prefill_rows, prompt, full, self.vocab, keep)
        return full

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

    check_request = _inner("check_request")
    stats = _inner("stats")
    timing_key = _inner("timing_key")
    pass_forms = _inner("pass_forms")
    form_serves = _inner("form_serves")
    time_pass = _inner("time_pass")
    forms_kept = _inner("forms_kept")
