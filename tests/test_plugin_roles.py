"""A plugin author's faults, in every role: a hook that raises is named (component and hook, the original
chained), options are strict, and a hook without @goose.hookimpl is refused or left out, never passed over."""

import types

import pytest

import goose
import goose.manager
from goose.policies.spine import SpinePolicy
from goose.testing import ToyCausalLM
from goose.verifiers.transformers_tree import TransformersVerifier

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


class Kaput(Exception):
    """What the faulty components raise: not a GooseError, so the loop must wrap it."""


def _fails(self, hook):
    if self.fail == hook:
        raise Kaput(f"{hook} went wrong")


class FaultySource(goose.DraftSource):
    """A chain and successor source that raises in the hook named by ``fail``."""

    name = "faulty-source"
    provides_successors = True

    def __init__(self, fail):
        super().__init__()
        self.fail = fail

    def begin(self, request):
        _fails(self, "begin")

    def prefill_positions(self, prompt_len):
        _fails(self, "prefill_positions")
        return 4

    def propose(self, state):
        _fails(self, "propose")
        return goose.Proposal.chain(self.name, [int(state.tokens[-4])] if len(state.tokens) > 4 else [0])

    def successors(self, token, prev):
        _fails(self, "successors")
        return [1, 2], [0.5, 0.25]

    def observe(self, verified):
        _fails(self, "observe")

    def stats(self):
        _fails(self, "stats")
        return {}

    def end(self, output):
        _fails(self, "end")


class FaultyPolicy(SpinePolicy):
    name = "faulty-policy"
    fail = None

    def bind(self, sources):
        _fails(self, "bind")
        super().bind(sources)

    def consulted(self, sources):
        _fails(self, "consulted")
        return super().consulted(sources)

    def attach(self, model, verifier):
        _fails(self, "attach")
        super().attach(model, verifier)

    def max_nodes(self, budget):
        _fails(self, "max_nodes")
        return super().max_nodes(budget)

    def begin(self, request):
        _fails(self, "begin")
        super().begin(request)

    def prefill_positions(self, prompt_len, wanted):
        _fails(self, "prefill_positions")
        return super().prefill_positions(prompt_len, wanted)

    def shape(self, ctx):
        _fails(self, "shape")
        return super().shape(ctx)

    def observe(self, verified):
        _fails(self, "observe")
        super().observe(verified)

    def stats(self):
        _fails(self, "stats")
        return super().stats()

    def end(self, output):
        _fails(self, "end")
        super().end(output)


class FaultyVerifier(TransformersVerifier):
    name = "faulty-verifier"
    fail = None

    def bind(self, model):
        _fails(self, "bind")
        super().bind(model)

    def check_request(self, prompt_len, max_new_tokens, max_depth):
        _fails(self, "check_request")
        super().check_request(prompt_len, max_new_tokens, max_depth)

    def prefill(self, prompt_ids, keep=None):
        _fails(self, "prefill")
        return super().prefill(prompt_ids, keep)

    def verify(self, tree):
        _fails(self, "verify")
        return super().verify(tree)

    def stats(self):
        _fails(self, "stats")
        return super().stats()

    def end(self):
        _fails(self, "end")
        super().end()


def _faulty_policy(hook):
    pol = FaultyPolicy()
    pol.fail = hook
    return pol


def _faulty_verifier(hook):
    ver = FaultyVerifier()
    ver.fail = hook
    return ver


SOURCE_HOOKS = ("begin", "prefill_positions", "propose", "successors", "observe", "stats", "end")
POLICY_HOOKS = ("bind", "consulted", "attach", "max_nodes", "begin", "prefill_positions", "shape", "observe", "stats", "end")
VERIFIER_HOOKS = ("bind", "check_request", "prefill", "verify", "stats", "end")
CASES = ([("source", h) for h in SOURCE_HOOKS] + [("policy", h) for h in POLICY_HOOKS]
         + [("verifier", h) for h in VERIFIER_HOOKS])
ERRORS = {"source": goose.DraftSourceError, "policy": goose.TreePolicyError, "verifier": goose.VerifierError}
NAMES = {"source": "faulty-source", "policy": "faulty-policy", "verifier": "faulty-verifier"}


@pytest.mark.parametrize("role,hook", CASES, ids=[f"{r}.{h}" for r, h in CASES])
def test_every_hook_that_raises_is_named_with_the_cause_chained(role, hook):
    """Each hook of each role raising a plain exception surfaces as that role's GooseError, naming the
    component and the hook, with the original exception as its cause; the model and a fresh decoder work on."""
    model = ToyCausalLM()
    src = FaultySource(hook if role == "source" else None)
    pol = _faulty_policy(hook if role == "policy" else None)
    ver = _faulty_verifier(hook if role == "verifier" else None)
    with pytest.raises(ERRORS[role]) as ei:
        dec = goose.compose(model, None, sources=[src, "pld", "tr"], policy=pol, verifier=ver)
        dec.generate(PROMPT, max_new_tokens=16)
    err = ei.value
    assert isinstance(err, goose.ComponentError) and isinstance(err, goose.GooseError)
    assert err.component == NAMES[role] and err.hook == hook, (err.component, err.hook, str(err))
    assert repr(NAMES[role]) in str(err) and f"{hook}(" in str(err) and "went wrong" in str(err), str(err)
    assert isinstance(err.__cause__, Kaput), f"the component's exception is not chained: {err.__cause__!r}"
    # nothing was lost: the same model composes and decodes as greedy
    ref = goose.greedy(model).generate(PROMPT, max_new_tokens=16).token_ids
    assert goose.compose(model, None, sources=["pld", "tr"], policy="spine").generate(PROMPT, max_new_tokens=16).token_ids == ref


def test_a_goose_error_a_component_raises_goes_through_as_raised():
    """A component's own GooseError says what is wrong already: the loop passes it on unchanged."""
    ver = _faulty_verifier(None)

    def refuse(prompt_len, max_new_tokens, max_depth):
        raise goose.InvalidInputError("prompts over 5 tokens are not served by this verifier")

    ver.check_request = refuse
    dec = goose.compose(ToyCausalLM(), None, sources=["pld"], verifier=ver)
    with pytest.raises(goose.InvalidInputError, match="over 5 tokens") as ei:
        dec.generate(PROMPT, max_new_tokens=4)
    assert not isinstance(ei.value, goose.ComponentError)


def test_a_verifier_that_returns_no_record_is_named():
    class NoRecord(TransformersVerifier):
        name = "no-record"

        def verify(self, tree):
            super().verify(tree)
            return None

    dec = goose.compose(ToyCausalLM(), None, sources=["pld"], verifier=NoRecord())
    with pytest.raises(goose.VerifierError, match=r"Verifier 'no-record' returned NoneType from verify\(\)") as ei:
        dec.generate(PROMPT, max_new_tokens=8)
    assert ei.value.hook == "verify"


# -- options ---------------------------------------------------------------------------------------
class FlagOptions(goose.Options):
    flag: bool = False
    maybe: bool | None = None
    count: int = 1


@pytest.mark.parametrize("value", ["yes", "true", "False", 1, 0, 1.0, "on"])
def test_a_bool_option_takes_true_or_false_only(value):
    with pytest.raises(ValueError, match=r"True or False is required"):
        FlagOptions(flag=value)
    with pytest.raises(ValueError, match=r"True or False is required"):
        FlagOptions(maybe=value)
    assert FlagOptions(flag=True, maybe=None).flag is True and FlagOptions(maybe=False).maybe is False


def test_a_builtin_bool_option_refuses_a_string_with_the_source_named():
    with pytest.raises(goose.InvalidInputError, match=r"Invalid options for source 'pld': extend: .*got 'yes'"):
        goose.compose(ToyCausalLM(), None, sources=[("pld", {"extend": "yes"})])
    # a method spec's true / false are bools
    from goose.specs import preset

    sources = preset("pld{extend=false}/chain")["sources"]
    assert sources == [("pld", {"extend": False})] and sources[0][1]["extend"] is False
    goose.compose(ToyCausalLM(), None, sources=sources)


@pytest.mark.parametrize("spec,kw", [
    (("pld", [1, 2]), {}),
    (("pld", "max_chain=4"), {}),
    ("pld", {"source_options": {"pld": [("max_chain", 4)]}}),
])
def test_options_that_are_not_a_dict_name_the_source(spec, kw):
    with pytest.raises(goose.InvalidInputError, match=r"options for source 'pld' must be a dict") as ei:
        goose.compose(ToyCausalLM(), None, sources=[spec], **kw)
    assert "Hint" in str(ei.value)


def test_policy_and_verifier_options_that_are_not_a_dict_are_named():
    with pytest.raises(goose.InvalidInputError, match=r"options for policy 'spine' must be a dict"):
        goose.compose(ToyCausalLM(), None, sources=["pld"], policy=("spine", [1]))
    with pytest.raises(goose.InvalidInputError, match=r"options for verifier 'transformers' must be a dict"):
        goose.compose(ToyCausalLM(), None, sources=["pld"], verifier_options=["linear"])


# -- hooks without @goose.hookimpl -----------------------------------------------------------------
class _Echo(goose.DraftSource):
    name = "unmarked-echo"

    def propose(self, state):
        return goose.Proposal.chain(self.name, [int(state.tokens[-1])])


def test_a_plugin_whose_hook_lacks_hookimpl_is_refused_at_registration():
    class Plugin:
        def goose_register_sources(self, register):  # no @goose.hookimpl: pluggy would never call it
            register(_Echo)

    with pytest.raises(goose.PluginError, match=r"'forgetful' defines goose_register_sources\(\) without @goose.hookimpl"):
        goose.register_plugin(Plugin(), name="forgetful")
    assert goose.manager.get_plugin_manager().get_plugin("forgetful") is None, "a refused plugin stays registered"
    # decorated, the same plugin registers
    Plugin.goose_register_sources = goose.hookimpl(Plugin.goose_register_sources)
    goose.register_plugin(Plugin(), name="forgetful")
    assert "unmarked-echo" in goose.get_registry().names("source")


def test_a_helper_named_like_a_hook_is_named_as_not_a_hook():
    ns = types.SimpleNamespace(goose_helper=lambda: None)
    with pytest.raises(goose.PluginError, match=r"goose_helper\(\) \(not a Goose hook either\)"):
        goose.register_plugin(ns, name="helper")


def test_an_installed_plugin_whose_hook_lacks_hookimpl_is_left_out_with_a_warning(monkeypatch):
    def goose_register_sources(register):
        register(_Echo)

    class EP:
        name, value, dist = "unmarked", "unmarked_mod:plugin", types.SimpleNamespace(name="unmarked-dist")

        def load(self):
            return types.SimpleNamespace(goose_register_sources=goose_register_sources)

    monkeypatch.setattr(goose.manager.metadata, "entry_points", lambda group: [EP()])
    with pytest.warns(goose.PluginWarning, match=r"left plugin 'unmarked' out: .*goose_register_sources\(\) without @goose.hookimpl"):
        names = goose.get_registry().names("source")
    assert "unmarked-echo" not in names and "pld" in names
    assert "unmarked" in goose.broken_plugins()


# -- what a source offered, and how a user chain source earns its share -----------------------------
class OracleChain(goose.DraftSource):
    """A user chain source that is always right on the toy model (its greedy continuation), ``length`` tokens."""

    name = "oracle-chain"

    def __init__(self, length=8, confidence=0.0):
        super().__init__()
        self.length, self.confidence, self.offered = length, confidence, 0

    def propose(self, state):
        from goose.testing.toy import reference_next

        seq, out = list(state.tokens), []
        for _ in range(self.length):
            out.append(reference_next(seq + out, 16))
        self.offered += len(out)
        return goose.Proposal.chain(self.name, out, confidence=self.confidence)


class Liar(goose.DraftSource):
    """A chain source whose measured tiers say it is right 95 % of the time, and that is always wrong."""

    name = "liar"

    def propose(self, state):
        from goose.testing.toy import reference_next

        seq, out = list(state.tokens), []
        for _ in range(12):
            out.append((reference_next(seq + out, 16) + 1) % 16)
        return goose.Proposal.chain(self.name, out, confidence=1.0)


def test_per_source_counts_what_each_source_proposed_beside_drafted_and_accepted():
    """``proposed`` is every token a source offered the policy (a chain's tokens, a successor answer's ids),
    ``drafted`` what the trees placed of it: a chain of 8 under a 4-node budget proposes 8 a step, drafts 3."""
    model = ToyCausalLM()
    src = OracleChain(8)
    offered_ids = []
    dec = goose.compose(model, None, sources=[src, "tr"], policy="spine", budget=4)
    tr = dec._idle[0].sources[1]
    inner = tr.successors

    def counting(token, prev):
        ids, scores = inner(token, prev)
        offered_ids.append(len(ids))
        return ids, scores

    tr.successors = counting
    out = dec.generate(PROMPT, max_new_tokens=40)
    per = out.stats.per_source
    assert per["oracle-chain"]["proposed"] == src.offered > 0
    assert per["tr"]["proposed"] == sum(offered_ids) > 0
    for name, d in per.items():
        assert d["proposed"] >= d["drafted"] >= d["accepted"], (name, d)
    assert per["oracle-chain"]["drafted"] < per["oracle-chain"]["proposed"], "the budget cut no chain: a weak check"
    assert out.stats.to_dict()["per_source"] == per


@pytest.mark.parametrize("policy,options", [
    ("spine", None), ("chain", None), ("iso3", None),
    ("spine-fit", {"latency": {1: 1.0, 2: 1.3, 4: 1.6, 8: 2.2, 16: 3.5, 128: 20.0}}),
])
def test_a_reliable_user_chain_source_earns_the_spine_from_a_source_with_better_priors(policy, options, tmp_path, monkeypatch):
    """The user's source starts at the pessimistic prior (no measured tiers); beside it a source whose tiers
    (as `goose tiers` writes them) promise 95 %, and which is always wrong. Every chain laid out is booked
    against the target's tokens, so within one generation the reliable source's rate rises past its prior and
    the liar's falls, and the reliable source leads: its tokens are most of what is generated."""
    from goose.policies import tiers

    monkeypatch.setenv("GOOSE_TIERS_DIR", str(tmp_path))
    tiers.save({"source": "liar", "version": "1", "model": tiers.model_key(ToyCausalLM()),
                "tiers": [[1.0, 0.95, 0.95]]})
    model = ToyCausalLM()
    dec = goose.compose(model, None, sources=[Liar(), OracleChain(8), "tr"], policy=policy, policy_options=options)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ref = goose.greedy(model).generate(prompt, max_new_tokens=60).token_ids
    outs = [dec.generate(prompt, max_new_tokens=60) for _ in range(2)]
    assert all(o.token_ids == ref for o in outs)
    first, second = outs
    rates = second.stats.extra["policy"]["source_rates"]
    assert rates["oracle-chain^0"][0] > 0.5 > rates["liar^1"][0], rates
    assert second.stats.per_source["oracle-chain"]["accepted"] >= 40, second.stats.per_source
    assert second.stats.per_source["liar"]["accepted"] == 0
    assert second.stats.forward_passes <= 20, second.stats.forward_passes
