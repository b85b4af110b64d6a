"""Sampling without loss (issue 12): the tree sampler equals one-token-at-a-time sampling under one seed.

On the exact toy model the tree pass's logits equal the one-token pass's, so the property is
exact: for arbitrary draft trees, prompts, temperatures, top-k / top-p / min-p and repetition
penalties, Goose's output equals a reference sampler (``goose.testing.reference_sample``: one
draw per token from transformers' processors, softmax and ``torch.multinomial``) under the same
generator, token for token, across EOS and ``max_new_tokens`` edges. The fault-injection tests
break the walk on purpose (a drafted child accepted without a draw, two draws for one token, the
processors given the wrong prefix) and check that the same property then fails.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.testing import ArbitraryTreeSource, ToyCausalLM, reference_sample
from goose.testing.kit import ArbitraryTreeOptions
from goose import sampling
from goose.sampling import Sampling, build_processors

V = 16

# fields both property tests draw alike
_COMMON = {
    "prompt": st.lists(st.integers(0, V - 1), min_size=1, max_size=30),
    "eos": st.none() | st.integers(0, V - 1),
    "seed": st.integers(0, 2**31 - 1),
    "temperature": st.sampled_from([0.3, 0.7, 1.0, 1.5]),
}

cases = st.fixed_dictionaries(
    {
        **_COMMON,
        "max_new": st.integers(0, 40),
        "budget": st.integers(1, 24),
        "tree_seed": st.integers(0, 2**31 - 1),
        "p_oracle": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
        "top_k": st.sampled_from([None, 0, 3, 8]),
        "top_p": st.sampled_from([None, 0.5, 0.9, 1.0]),
        "min_p": st.sampled_from([None, 0.1]),
        "repetition_penalty": st.sampled_from([None, 1.3]),
        "do_sample": st.sampled_from([True, True, True, False]),
        "user_processor": st.booleans(),
        "tape": st.booleans(),
    }
)


def _params(c):
    return dict(
        do_sample=c["do_sample"], temperature=c["temperature"] if c["do_sample"] else None, top_k=c["top_k"],
        top_p=c["top_p"], min_p=c["min_p"], repetition_penalty=c["repetition_penalty"],
    )


class LastTokenBias:
    """A user logits processor that depends on the exact prefix: favours (last token + 1) mod V."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[0, (int(input_ids[0, -1]) + 1) % scores.shape[-1]] += 2.0
        return scores


def run(c):
    """(Goose's output, the reference's tokens); both generators' final states are left in ``c["states"]``."""
    saved = list(sampling._GUMBEL)
    if not c.get("tape", True):
        sampling._GUMBEL[:] = [False]  # draws through torch.multinomial, no noise drawn ahead
    try:
        return _run(c)
    finally:
        sampling._GUMBEL[:] = saved


def _run(c):
    model = ToyCausalLM(V, eos_token_id=c["eos"])
    src = ArbitraryTreeSource(ArbitraryTreeOptions(seed=c["tree_seed"], p_oracle=c["p_oracle"], p_chain=0.5))
    dec = goose.compose(model, None, sources=[src], policy="proposal", budget=c["budget"])
    p = _params(c)
    user = [LastTokenBias()] if c.get("user_processor") else None
    g_out, g_ref = torch.Generator().manual_seed(c["seed"]), torch.Generator().manual_seed(c["seed"])
    out = dec.generate(c["prompt"], max_new_tokens=c["max_new"], generator=g_out, logits_processor=user, **p)
    procs = build_processors(Sampling(**p), len(c["prompt"]), [] if c["eos"] is None else [c["eos"]])
    if user:
        procs.extend(user)
    ref = reference_sample(c["prompt"], c["max_new"], V, procs, g_ref,
                           [] if c["eos"] is None else [c["eos"]], do_sample=c["do_sample"])
    c["states"] = (g_out.get_state(), g_ref.get_state())
    return out, ref


@given(cases)
def test_tree_sampling_equals_one_token_sampling_under_one_seed(c):
    out, ref = run(c)
    assert out.token_ids == ref
    # one draw per committed token, no more: the generator ends where transformers' loop leaves it
    # (noise drawn ahead for tokens that were never committed is undone)
    assert torch.equal(*c["states"])
    if c["do_sample"] and c["max_new"]:
        assert out.stats.extra["sampling"]["draws"] == len(ref)


coupled_cases = st.fixed_dictionaries(
    {
        **_COMMON,
        "max_new": st.integers(1, 40),
        "budget": st.integers(2, 24),
        "top_k": st.sampled_from([None, 3, 8]),
        "top_p": st.sampled_from([None, 0.5, 0.9]),
        "policy": st.sampled_from(["spine", "spine-fit"]),
        "global_rng": st.booleans(),
    }
)


def _coupled(c, coupled=True):
    """Goose with pld + tr under the spine policy (its drafting reads the noise ahead) and the reference."""
    model = ToyCausalLM(V, eos_token_id=c["eos"])
    inner = {"coupled": coupled}
    opts = {"inner_options": inner} if c["policy"] == "spine" else {"inner_options": {"inner_options": inner},
                                                                      "latency": {1: 1.0, 8: 1.05, 32: 1.2}}
    dec = goose.compose(model, None, sources=["pld", "tr"], policy=c["policy"], policy_options=opts, budget=c["budget"])
    p = dict(do_sample=True, temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"])
    eos = [] if c["eos"] is None else [c["eos"]]
    procs = build_processors(Sampling(**p), len(c["prompt"]), eos)
    if c["global_rng"]:
        torch.manual_seed(c["seed"])
        out = dec.generate(c["prompt"], max_new_tokens=c["max_new"], **p)
        after = torch.get_rng_state()
        torch.manual_seed(c["seed"])
        ref = reference_sample(c["prompt"], c["max_new"], V, procs, None, eos)
        return out, ref, after, torch.get_rng_state()
    g_out, g_ref = torch.Generator().manual_seed(c["seed"]), torch.Generator().manual_seed(c["seed"])
    out = dec.generate(c["prompt"], max_new_tokens=c["max_new"], generator=g_out, **p)
    ref = reference_sample(c["prompt"], c["max_new"], V, procs, g_ref, eos)
    return out, ref, g_out.get_state(), g_ref.get_state()


@given(coupled_cases)
def test_drafting_from_the_noise_keeps_one_token_sampling(c):
    """Drafts ordered by the draws' noise (drawn ahead of each forward) change nothing but the drafts:
    the tokens and the generator's final state equal one-token sampling's."""
    out, ref, after, want = _coupled(c)
    assert out.token_ids == ref
    assert torch.equal(after, want)


def test_fault_noise_drawn_ahead_is_not_undone(monkeypatch):
    """Without the rewind at the end, the fills drafting drew for tokens never committed stay spent
    (a generation that ends on a stop token before the deepest drafted depth)."""
    monkeypatch.setattr(sampling.NoiseTape, "finish", lambda self: None)
    bad = 0
    for i in range(12):
        c = dict(prompt=[(i * 3 + j) % V for j in range(10)], max_new=40, budget=16, eos=i % V, seed=i,
                 temperature=0.7, top_k=None, top_p=None, policy="spine", global_rng=False)
        out, ref, after, want = _coupled(c)
        assert out.token_ids == ref  # the tokens are right; the generator is left ahead
        bad += not torch.equal(after, want)
    assert bad > 0


class BigramLM(ToyCausalLM):
    """The toy's forward contract (cache, mask, positions) with logits that depend on the last token only.

    Token recycling's row for a token is then the target's own next-token distribution (up to its
    top-K), the case where ordering successors by the noise makes the first one the drawn token.
    """

    def __init__(self, vocab_size: int, seed: int):
        super().__init__(vocab_size)
        self.table = torch.randn((vocab_size, vocab_size), generator=torch.Generator().manual_seed(seed)) * 1.5

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kwargs):
        out = super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kwargs)
        out.logits = self.table[input_ids[0].long()].unsqueeze(0)
        return out


def _bigram_tau(coupled: bool) -> float:
    toks = fwd = 0
    for i in range(6):
        model = BigramLM(V, seed=i)
        dec = goose.compose(model, None, sources=["tr"], policy="spine-tree", policy_options={"coupled": coupled}, budget=12)
        prompt = [(i * 7 + j * 3) % V for j in range(24)]
        out = dec.generate(prompt, max_new_tokens=60, do_sample=True, temperature=1.0, generator=torch.Generator().manual_seed(i))
        g, seq, ref = torch.Generator().manual_seed(i), list(prompt), []
        for _ in range(60):  # one draw per token from the bigram row, as transformers' loop
            ref.append(int(torch.multinomial(torch.softmax(model.table[seq[-1]].view(1, -1), -1), 1, generator=g)[0, 0]))
            seq.append(ref[-1])
        assert out.token_ids == ref
        toks += len(out.token_ids)
        fwd += out.stats.forward_passes
    return toks / fwd


def test_coupled_drafts_are_accepted_more_often():
    """Where the successors estimate the target's distribution, the noise-ordered tree accepts more per forward."""
    on, off = _bigram_tau(True), _bigram_tau(False)
    assert on > 1.2 * off, (on, off)  # measured: 2.77 against 2.09 tokens per forward


def test_drafts_are_accepted_by_draws():
    """Likely drafts are accepted under sampling: fewer forwards than tokens, and stats per source."""
    c = dict(prompt=[1, 2, 3, 4, 1, 2, 3], max_new=40, budget=16, eos=None, tree_seed=3, p_oracle=1.0,
             seed=7, temperature=0.3, top_k=None, top_p=None, min_p=None, repetition_penalty=None, do_sample=True)
    out, ref = run(c)
    assert out.token_ids == ref
    assert out.stats.forward_passes < len(ref)
    acc = sum(d["accepted"] for d in out.stats.per_source.values())
    assert acc == len(ref) - out.stats.forward_passes  # every accepted draft saved one forward


def test_global_generator_is_used_like_transformers():
    model = ToyCausalLM(V)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.manual_seed(11)
    a = dec.generate(prompt, max_new_tokens=30, do_sample=True, temperature=0.8).token_ids
    torch.manual_seed(11)
    b = reference_sample(prompt, 30, V, build_processors(Sampling(True, 0.8), len(prompt), []), None)
    assert a == b
    c = dec.generate(prompt, max_new_tokens=30, do_sample=True, temperature=0.8, seed=11).token_ids
    d = dec.generate(prompt, max_new_tokens=30, do_sample=True, temperature=0.8, seed=11).token_ids
    assert c == d  # a per-call seed is its own generator


def test_stopping_criteria_cut_where_transformers_would():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterToken(StoppingCriteria):
        def __init__(self, tok):
            self.tok = tok

        def __call__(self, input_ids, scores, **kw):
            return input_ids[:, -1] == self.tok

    model = ToyCausalLM(V)
    prompt = [1, 2, 3, 4, 5, 6]
    ref = reference_sample(prompt, 40, V, build_processors(Sampling(True, 1.0), len(prompt), []), torch.Generator().manual_seed(5))
    stop_at = ref[10]
    want = ref[: ref.index(stop_at) + 1]
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16)
    out = dec.generate(prompt, max_new_tokens=40, do_sample=True, seed=5, stopping_criteria=StoppingCriteriaList([AfterToken(stop_at)]))
    assert out.token_ids == want and out.stats.stopped_by == "stopping_criteria"


def test_min_new_tokens_suppresses_eos_as_transformers_does():
    model = ToyCausalLM(V, eos_token_id=0)
    prompt = [5, 5, 5]
    procs = build_processors(Sampling(True, 1.5, min_new_tokens=12), len(prompt), [0])
    ref = reference_sample(prompt, 30, V, procs, torch.Generator().manual_seed(2), [0])
    out = goose.compose(model, None, sources=["pld"], policy="chain", budget=8).generate(
        prompt, max_new_tokens=30, do_sample=True, temperature=1.5, min_new_tokens=12, seed=2)
    assert out.token_ids == ref and 0 not in ref[:12]


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"temperature": -1.0}, "temperature=-1.0 is not allowed"),
        ({"do_sample": True, "temperature": 0}, "> 0 when do_sample=True"),
        ({"top_k": -2}, "top_k=-2"),
        ({"top_p": 0.0}, r"top_p=0.0 .*\(0, 1\]"),
        ({"min_p": 2.0}, "min_p=2.0"),
        ({"repetition_penalty": 0}, "repetition_penalty=0"),
        ({"min_new_tokens": -1}, "min_new_tokens=-1"),
        ({"seed": 1, "generator": torch.Generator()}, "seed or generator, not both"),
        ({"seed": "x"}, "seed must be an int"),
    ],
)
def test_bad_sampling_options_are_named(kw, msg):
    dec = goose.compose(ToyCausalLM(V), None, sources=["pld"], policy="chain")
    with pytest.raises(goose.InvalidInputError, match=msg):
        dec.generate([1, 2, 3], max_new_tokens=4, **kw)
    assert len(dec.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


# -- fault injection: the property must catch a broken walk --------------------------------------
FAULT_CASES = [
    dict(prompt=[(i * 5 + j) % V for j in range(8)], max_new=30, budget=16, eos=None, tree_seed=i, p_oracle=0.9,
         seed=100 + i, temperature=0.9, top_k=None, top_p=None, min_p=None, repetition_penalty=1.3, do_sample=True,
         user_processor=True)
    for i in range(12)
]


def _fails_somewhere(monkeypatch, walk, tape=True):
    monkeypatch.setattr(sampling, "rule_walk", walk)
    bad = 0
    for c in FAULT_CASES:
        out, ref = run({**c, "tape": tape})
        bad += out.token_ids != ref
    return bad


def test_the_property_holds_on_the_fault_cases():
    assert all(out.token_ids == ref for out, ref in map(run, FAULT_CASES))


def _trusting_walk(tree, logits, rule, choose=None):
    """A broken walk: the first drafted child of the root is taken on trust, the draws start below it."""
    if not tree.children[0]:
        return sampling.walk_from(tree, logits, rule, rule.choose, [0], [])
    c = tree.children[0][0]
    t = tree.tokens[c]
    if rule.ends([t]):
        return (0, c), (t,), None
    return sampling.walk_from(tree, logits, rule, rule.choose, [0, c], [t])


def test_fault_accepting_a_drafted_child_without_a_draw(monkeypatch):
    assert _fails_somewhere(monkeypatch, _trusting_walk) > 0


@pytest.mark.parametrize("tape", [True, False])
def test_fault_two_draws_for_one_token(monkeypatch, tape):
    real = sampling.rule_walk

    def walk(tree, logits, rule, choose=None):
        def twice(row, before):
            probs = torch.softmax(row.float().view(1, -1), dim=-1)
            torch.multinomial(probs, num_samples=1, generator=rule.generator)  # a wasted draw
            return rule.choose(row, before)

        return real(tree, logits, rule, choose=twice)

    assert _fails_somewhere(monkeypatch, walk, tape) > 0


def test_torch_draws_one_sample_as_argmax_of_p_over_exponential_noise():
    """The premise of the noise tape on the pinned torch: multinomial(p, 1) == argmax(p / q), same generator state."""
    assert sampling._probe_gumbel()
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    tape = sampling.NoiseTape(g2, 1000)
    for j in range(40):
        p = torch.softmax(torch.randn(1, 1000, generator=torch.Generator().manual_seed(j)) * 3, -1)
        want = int(torch.multinomial(p, 1, generator=g1)[0, 0])
        assert int(torch.argmax(p / tape.noise(j))) == want
        tape.spend(j)
        tape.release(j)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_raw_fills_are_torchs_exponential_fills_to_the_bit():
    """The fills drawn through numpy's engine: values and generator state as torch's exponential_."""
    assert sampling._probe_raw_fills()
    g, ref = torch.Generator().manual_seed(123), torch.Generator().manual_seed(123)
    tape = sampling.NoiseTape(g, 49152)
    assert tape.raw
    for j in range(4):
        want = torch.empty((1, 49152)).exponential_(generator=ref)
        ids = [0, 17, 49151, 30000]
        assert np.array_equal(tape.noise_at(j, ids), want.numpy()[0, ids])  # read before the whole fill exists
        assert torch.equal(tape.noise(j), want)
    assert torch.equal(g.get_state(), ref.get_state())


def test_draw_over_the_support_is_the_full_argmax():
    """tape.draw: argmax(probs / q) over the nonzero entries equals the division over the whole row."""
    g = torch.Generator().manual_seed(4)
    tape = sampling.NoiseTape(g, 3000)
    for j in range(30):
        logits = torch.randn(1, 3000, generator=torch.Generator().manual_seed(j)) * 2
        keep = torch.topk(logits, 1 + j % 40).indices
        masked = torch.full_like(logits, -float("inf")).scatter(1, keep, logits.gather(1, keep))
        probs = torch.softmax(masked, -1)
        full = int(torch.argmax(probs / sampling._Fill(tape._fill(j).raw).tensor()))
        assert tape.draw(j, probs) == full


def test_draw_with_a_zero_in_the_fill_divides_the_whole_row():
    """An exactly-0 noise entry (u == 0) off the support makes torch's p / q NaN there; the draw does as torch."""
    raw = np.random.MT19937(1).random_raw(2 * 8)
    raw[2 * 5], raw[2 * 5 + 1] = 0, 0  # element 5: u == 0, q == 0
    fill = sampling._Fill(raw)
    assert fill.has_zero() and fill.at([5])[0] == 0.0
    tape = sampling.NoiseTape(torch.Generator().manual_seed(0), 8)
    tape.fills, tape.states = [fill], [tape.gen.get_state()]
    probs = torch.tensor([[0.5, 0.5, 0, 0, 0, 0, 0, 0]])
    assert tape.draw(0, probs) == int(torch.argmax(probs / fill.tensor())) == 5  # NaN is torch's maximum


def test_noise_tape_rewinds_fills_drawn_ahead():
    g, ref = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    tape = sampling.NoiseTape(g, 64)
    tape.noise(11)  # twelve fills drawn ahead
    tape.spend(4)  # five of them used
    tape.finish()
    for _ in range(5):
        torch.empty((1, 64)).exponential_(generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())


def test_noise_tape_leaves_other_draws_alone():
    """Someone else drew from the generator after the tape's last fill: no rewind over their draw."""
    g = torch.Generator().manual_seed(9)
    tape = sampling.NoiseTape(g, 64)
    tape.noise(11)
    tape.spend(4)
    torch.rand(3, generator=g)  # e.g. another thread on a shared generator
    after = g.get_state()
    tape.finish()
    assert torch.equal(g.get_state(), after)


def test_sampled_generation_draws_through_the_tape():
    dec = goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="spine", budget=8)
    seen = []
    real = sampling.TokenRule.finish

    def spy(self):
        seen.append(self.tape)
        real(self)

    import unittest.mock as um

    with um.patch.object(sampling.TokenRule, "finish", spy):
        dec.generate([1, 2, 3, 1, 2], max_new_tokens=12, do_sample=True, seed=1)
    assert seen and isinstance(seen[0], sampling.NoiseTape) and seen[0].used == 12


def test_noise_view_orders_successors_by_the_draw():
    """score ** (1/T) / q: a likelier token loses to one whose noise is far smaller; scores are the keys, normalised."""
    g = torch.Generator().manual_seed(0)
    tape = sampling.NoiseTape(g, 8)
    q = tape.noise(3)  # depth 1 of a step whose next token is the 4th generated
    q[0, :] = 1.0
    q[0, 5] = 0.1  # token 5's draw noise is small: it wins with 0.3 against 0.5
    view = sampling.NoiseView(tape, base=3, temperature=1.0, max_depth=4)
    ids, scores = view.rank([2, 5, 7], [0.5, 0.3, 0.2], depth=1)
    assert list(ids) == [5, 2, 7]
    assert scores == pytest.approx([3.0 / 3.7, 0.5 / 3.7, 0.2 / 3.7])
    # temperature sharpens the estimate: at T = 0.2 the likelier token's key 0.5**5 beats 0.3**5 / 0.1
    cold = sampling.NoiseView(tape, base=3, temperature=0.2, max_depth=4)
    assert list(cold.rank([2, 5, 7], [0.5, 0.3, 0.2], depth=1)[0]) == [2, 5, 7]
    # beyond the depth it reads, and for a single candidate, the source's order stands
    assert view.rank([2, 5], [0.5, 0.3], depth=5) == ([2, 5], [0.5, 0.3])
    assert view.rank([5], [0.3], depth=1) == ([5], [0.3])


def test_fault_noise_of_the_wrong_token(monkeypatch):
    """The noise drawn ahead must be the fill of the token being drawn: one fill off and the property fails."""
    real = sampling.NoiseTape._fill
    monkeypatch.setattr(sampling.NoiseTape, "_fill", lambda self, j: real(self, j + 1))
    assert _fails_somewhere(monkeypatch, sampling.rule_walk) > 0


def test_fault_processors_on_the_wrong_prefix(monkeypatch):
    real = sampling.rule_walk

    def walk(tree, logits, rule, choose=None):
        return real(tree, logits, rule, choose=lambda row, before: rule.choose(row, before[:-1]))

    assert _fails_somewhere(monkeypatch, walk) > 0


def test_streamer_gets_the_prompt_every_committed_chunk_and_one_end():
    class Rec:
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.view(-1).tolist())

        def end(self):
            self.ends += 1

    dec = goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="spine", budget=16)
    prompt = [1, 2, 3, 1, 2, 3]
    rec = Rec()
    out = dec.generate(prompt, max_new_tokens=30, streamer=rec)
    assert rec.puts[0] == prompt and rec.ends == 1
    assert [t for chunk in rec.puts[1:] for t in chunk] == out.token_ids
    assert len(rec.puts) - 1 == out.stats.forward_passes  # one chunk per pass (prefill included)
    rec = Rec()
    dec.generate(prompt, max_new_tokens=5, streamer=rec, stream_prompt=False, do_sample=True, seed=1)
    assert rec.ends == 1 and sum(len(c) for c in rec.puts) == 5


def test_recorded_scores_are_the_processed_rows_of_each_new_token():
    dec = goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="spine", budget=16)
    prompt = [4, 5, 6, 4, 5]
    out = dec.generate(prompt, max_new_tokens=12, do_sample=True, temperature=0.5, seed=3, record_scores=True)
    from goose.testing import reference_logits

    seq = list(prompt)
    assert len(out.scores) == len(out.logits) == len(out.token_ids)
    for tok, sc, raw in zip(out.token_ids, out.scores, out.logits):
        want = reference_logits(seq, V)
        assert torch.equal(raw, want) and torch.allclose(sc, want / 0.5)
        seq.append(tok)


# -- the distribution, seed-free ------------------------------------------------------------------
def _exact_distribution(prompt, horizon, vocab, temperature):
    """P(sequence) under one-token sampling of the toy, for every sequence of ``horizon`` tokens."""
    import itertools

    from goose.testing import reference_logits

    probs = {}
    for seq in itertools.product(range(vocab), repeat=horizon):
        p, ctx = 1.0, list(prompt)
        for t in seq:
            p *= float(torch.softmax(reference_logits(ctx, vocab)[0] / temperature, -1)[t])
            ctx.append(t)
        probs[seq] = p
    return probs


def _chi2_stat(counts, probs, n):
    """Pearson's statistic, cells with expectation < 5 pooled; returns (statistic, degrees of freedom)."""
    stat, rest_obs, rest_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in probs.items():
        e = n * p
        if e < 5:
            rest_obs += counts.get(seq, 0)
            rest_exp += e
            continue
        stat += (counts.get(seq, 0) - e) ** 2 / e
        cells += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    return stat, cells - 1


def _critical(df, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile at false-alarm rate 0.001 (z = 3.09)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _sampled_counts(p_oracle, n, prompt, horizon, vocab, temperature):
    from collections import Counter

    model = ToyCausalLM(vocab)
    src = ArbitraryTreeSource(ArbitraryTreeOptions(seed=1, p_oracle=p_oracle, p_chain=0.7))
    dec = goose.compose(model, None, sources=[src], policy="proposal", budget=8)
    counts = Counter()
    for s in range(n):
        out = dec.generate(prompt, max_new_tokens=horizon, do_sample=True, temperature=temperature, seed=s)
        counts[tuple(out.token_ids)] += 1
    return counts


@pytest.mark.parametrize("p_oracle", [1.0, 0.0], ids=["drafts-the-likeliest", "drafts-unlikely-tokens"])
def test_output_distribution_is_the_models(p_oracle):
    """Exact probabilities of all 4^3 continuations against 3,000 tree-sampled ones (chi-square,
    false-alarm rate 0.001 per check), with a source drafting the greedy (likeliest) tokens and one
    drafting arbitrary ones."""
    prompt, horizon, vocab, temperature, n = [1, 2, 3], 3, 4, 1.0, 3000
    probs = _exact_distribution(prompt, horizon, vocab, temperature)
    assert abs(sum(probs.values()) - 1) < 1e-5  # float32 softmax
    stat, df = _chi2_stat(_sampled_counts(p_oracle, n, prompt, horizon, vocab, temperature), probs, n)
    assert stat < _critical(df), (stat, df)


def test_the_distribution_check_catches_a_walk_that_accepts_drafts_without_drawing(monkeypatch):
    monkeypatch.setattr(sampling, "rule_walk", _trusting_walk)
    prompt, horizon, vocab, temperature, n = [1, 2, 3], 3, 4, 1.0, 3000
    probs = _exact_distribution(prompt, horizon, vocab, temperature)
    stat, df = _chi2_stat(_sampled_counts(1.0, n, prompt, horizon, vocab, temperature), probs, n)
    assert stat > _critical(df), (stat, df)


# -- FastTopP: the stock top-p warper's output, bit for bit ----------------------------------------


def _top_p_rows():
    """(name, row) pairs: real-looking rows, rows after top-k, and rows built to hit each fallback."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    g = torch.Generator().manual_seed(7)
    rows = []
    for scale in (0.5, 3.0, 12.0):
        for v in (7, 1000, 49152):
            x = torch.randn(1, v, generator=g) * scale
            rows.append((f"normal-{scale}-{v}", x))
            rows.append((f"temp-{scale}-{v}", TemperatureLogitsWarper(0.7)(None, x.clone())))
            if v > 50:
                rows.append((f"topk50-{scale}-{v}", TopKLogitsWarper(50)(None, x.clone())))
    grid = torch.round(torch.randn(1, 3000, generator=g) * 4) / 4  # many exact ties
    rows.append(("ties", grid))
    one = torch.full((1, 100), -float("inf"))
    one[0, 17] = 2.0
    rows.append(("one-finite", one))
    nan = torch.randn(1, 100, generator=g)
    nan[0, 3] = float("nan")
    rows.append(("nan", nan))
    sparse = TopKLogitsWarper(20)(None, torch.randn(1, 1000, generator=g))  # mostly -inf: the short sort
    for name, v in (("sparse-nan", float("nan")), ("sparse-inf", float("inf"))):
        r = sparse.clone()
        r[0, 500] = v
        rows.append((name, r))
    return rows


def test_sorted_values_equal_numpy_sort():
    g = np.random.default_rng(3)
    for n_finite in (0, 1, 5, 40, 400, 1000):
        x = np.full(1000, -np.inf, dtype=np.float32)
        x[g.choice(1000, n_finite, replace=False)] = g.normal(size=n_finite).astype(np.float32)
        for extra in ((), (float("nan"),), (float("inf"), float("nan"))):
            y = x.copy()
            y[: len(extra)] = extra
            assert np.array_equal(sampling._sorted_values(y), np.sort(y), equal_nan=True)


@pytest.mark.parametrize("min_keep", [1, 3])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_fast_top_p_equals_transformers_top_p(top_p, min_keep):
    from transformers import TopPLogitsWarper

    stock = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=min_keep)
    fast = sampling.FastTopP(stock)
    fast_path = 0
    for name, row in _top_p_rows():
        want = stock(None, row.clone())
        before = fast.fallbacks
        got = fast(None, row.clone())
        fast_path += fast.fallbacks == before
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (name, top_p, min_keep)
    assert fast_path >= 20  # the numpy path, not the fallback, served most rows


def test_fast_top_p_falls_back_on_a_tie_across_the_cut():
    from transformers import TopPLogitsWarper

    row = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0]])  # each zero has p = 0.0066: the cut falls after two
    stock = TopPLogitsWarper(top_p=0.985)
    fast = sampling.FastTopP(stock)
    assert torch.equal(fast(None, row.clone()), stock(None, row.clone()))
    assert fast.fallbacks == 1


def test_sampling_rule_serves_top_p_with_the_fast_warper():
    from transformers import TopPLogitsWarper

    procs = build_processors(Sampling(do_sample=True, temperature=0.7, top_p=0.9), 3, [0])
    rule = sampling.TokenRule([1, 2, 3], 8, 16, procs, do_sample=True)
    assert any(isinstance(p, sampling.FastTopP) for p in rule.processors)
    assert not any(type(p) is TopPLogitsWarper for p in rule.processors)
