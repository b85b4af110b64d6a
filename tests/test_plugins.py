"""The plugin framework: registry, entry points, errors for bad plugins, observer hooks."""

import importlib.util
import inspect
import re
import types
from pathlib import Path

import pytest

import goose
import goose.hookspecs
import goose.manager
from goose.tools.cli import main as cli_main
from goose.testing import PolicyLosslessnessKit, SourceLosslessnessKit, ToyCausalLM, VerifierLosslessnessKit

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_INSTALLED = importlib.util.find_spec("goose_example_source") is not None


def _plugin(**hooks):
    """A plugin object from hook functions (names are hook names)."""
    ns = types.SimpleNamespace()
    for name, fn in hooks.items():
        setattr(ns, name, goose.hookimpl(fn))
    return ns


def test_builtins_are_registered_through_hooks():
    reg = goose.get_registry()
    assert "pld" in reg.names("source")
    assert {"chain", "greedy", "proposal"} <= set(reg.names("policy"))
    assert "greedy" in reg.names("verifier")
    e = reg.get("source", "pld")
    assert e.provider == "goose.plugins.pld" and e.origin == "builtin"


def test_plugins_cli_lists_components_and_origin(capsys):
    assert cli_main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+pld\s+\[goose\.plugins\.pld\.PLDSource; plugin goose\.plugins\.pld, builtin\]", out, re.M)
    assert "Tree policies:" in out and "Verifiers:" in out


@pytest.mark.parametrize(
    "kwargs, kind, hint",
    [
        ({"sources": ["pdl"]}, "draft source 'pdl'", "Did you mean 'pld'?"),
        ({"policy": "chian"}, "tree policy 'chian'", "Did you mean 'chain'?"),
        ({"verifier": "greedyy"}, "verifier 'greedyy'", "Did you mean 'greedy'?"),
        ({"sources": ["zzzz"]}, "draft source 'zzzz'", "goose plugins"),
    ],
)
def test_unknown_names_list_available_and_hint(kwargs, kind, hint):
    with pytest.raises(goose.UnknownComponentError) as ei:
        goose.compose(ToyCausalLM(), None, **kwargs)
    msg = str(ei.value)
    assert f"Unknown {kind}" in msg and "Available:" in msg and hint in msg


def test_options_are_validated_with_allowed_fields():
    with pytest.raises(goose.InvalidInputError) as ei:
        goose.compose(ToyCausalLM(), None, sources=[("pld", {"max_chian": 5})])
    msg = str(ei.value)
    assert "max_chian" in msg and "Allowed options:" in msg and "max_chain" in msg
    with pytest.raises(goose.InvalidInputError, match="max_chain"):
        goose.compose(ToyCausalLM(), None, sources=["pld"], source_options={"pld": {"max_chain": 0}})
    with pytest.raises(goose.InvalidInputError, match="source_options names"):
        goose.compose(ToyCausalLM(), None, sources=["pld"], source_options={"tr": {}})
    with pytest.raises(goose.InvalidInputError, match="listed twice"):
        goose.compose(ToyCausalLM(), None, sources=["pld", "pld"])
    with pytest.raises(goose.InvalidInputError, match="budget"):
        goose.compose(ToyCausalLM(), None, budget=0)


class _Echo(goose.DraftSource):
    name = "echo"

    def propose(self, state):
        return goose.Proposal.chain(self.name, list(state.tokens[-3:]))


def test_runtime_plugin_registers_and_composes_by_name():
    goose.register_plugin(_plugin(goose_register_sources=lambda register: register(_Echo)), name="echo-plugin")
    e = goose.get_registry().get("source", "echo")
    assert e.provider == "echo-plugin"
    dec = goose.compose(ToyCausalLM(), None, sources=["echo"], policy="chain")
    assert len(dec.generate([1, 2, 3], max_new_tokens=5).token_ids) == 5


def test_policy_and_verifier_plugins_register_through_hooks():
    from goose.verifiers.transformers_tree import TransformersVerifier

    class FirstTwo(goose.TreePolicy):
        """Verify only the first two drafted tokens of the first proposal."""

        name = "first-two"

        def shape(self, ctx):
            for p in ctx.proposals().values():
                return goose.DraftTree.from_chain(ctx.state.anchor, p.tokens[:2], p.source)
            return None

    class CountingVerifier(TransformersVerifier):
        name = "counting"
        calls = 0

        def verify(self, tree):
            CountingVerifier.calls += 1
            return super().verify(tree)

    goose.register_plugin(
        _plugin(
            goose_register_policies=lambda register: register(FirstTwo),
            goose_register_verifiers=lambda register: register(CountingVerifier),
        ),
        name="pv-plugin",
    )
    dec = goose.compose(ToyCausalLM(), None, sources=["pld"], policy="first-two", verifier="counting")
    out = dec.generate([1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=12)
    assert CountingVerifier.calls == out.stats.steps > 0
    assert max(out.stats.accept_lengths) <= 2


def test_duplicate_name_names_both_providers():
    class Dup(_Echo):
        name = "pld"

    with pytest.raises(goose.PluginError) as ei:
        goose.register_plugin(_plugin(goose_register_sources=lambda register: register(Dup)), name="dup-plugin")
    msg = str(ei.value)
    assert "Duplicate draft source name 'pld'" in msg and "goose.plugins.pld" in msg and "dup-plugin" in msg
    assert goose.get_registry().get("source", "pld").cls.__name__ == "PLDSource"  # nothing of it stayed


@pytest.mark.parametrize(
    "register_call, expected",
    [
        (lambda register: register(int), "not a subclass of goose.DraftSource"),
        (lambda register: register(goose.DraftSource, name="abstract"), "without implementing: propose"),
        (lambda register: register(type("NoName", (_Echo,), {"name": ""})), "with no name"),
        (lambda register: register(type("BadOpts", (_Echo,), {"name": "badopts", "Options": dict})), "Options must subclass goose.Options"),
        (lambda register: register(_Echo, name="echo2", defaults={"nope": 1}), "defaults for 'echo2' are invalid"),
        (lambda register: 1 / 0, "raised in goose_register_sources: ZeroDivisionError"),
    ],
)
def test_malformed_registrations_are_refused(register_call, expected):
    """Refused when registered, atomically: nothing stays, the next good plugin and every compose work."""
    with pytest.raises(goose.PluginError) as ei:
        goose.register_plugin(_plugin(goose_register_sources=register_call), name="bad-plugin")
    assert expected in str(ei.value) and "bad-plugin" in str(ei.value)
    assert goose.manager.get_plugin_manager().get_plugin("bad-plugin") is None
    assert "abstract" not in goose.get_registry().names("source")
    goose.register_plugin(_plugin(goose_register_sources=lambda register: register(_Echo)), name="bad-plugin")
    assert "echo" in goose.get_registry().names("source")  # the same name, now a good plugin
    out = goose.compose(ToyCausalLM(), None, sources=["pld"], policy="chain").generate([1, 2, 3], max_new_tokens=4)
    assert len(out.token_ids) == 4


def test_hook_with_unknown_name_is_refused():
    bad = _plugin(goose_register_source=lambda register: None)  # typo: missing 's'
    with pytest.raises(goose.PluginError, match="goose_register_source.*Known hooks: .*goose_register_sources"):
        goose.register_plugin(bad, name="typo-plugin")
    assert goose.manager.get_plugin_manager().get_plugin("typo-plugin") is None  # not left behind
    goose.register_plugin(_plugin(goose_register_sources=lambda register: register(_Echo)), name="typo-plugin")


def test_registering_a_name_twice_and_unregistering_an_unknown_one_are_named():
    goose.register_plugin(_plugin(goose_register_sources=lambda register: register(_Echo)), name="echo-plugin")
    with pytest.raises(goose.PluginError, match=r"named 'echo-plugin' is registered already.*unregister_plugin\('echo-plugin'\)"):
        goose.register_plugin(_plugin(goose_register_sources=lambda register: None), name="echo-plugin")
    goose.unregister_plugin("echo-plugin")
    assert "echo" not in goose.get_registry().names("source")
    with pytest.raises(goose.PluginError, match=r"No plugin named 'echo-plugin' is registered. Registered: .*goose.plugins.pld"):
        goose.unregister_plugin("echo-plugin")


def test_hook_with_wrong_arguments_is_refused():
    bad = _plugin(goose_register_sources=lambda registrar: None)
    with pytest.raises(goose.PluginError, match="malformed"):
        goose.register_plugin(bad, name="args-plugin")


def test_entry_point_that_fails_to_load_is_named(monkeypatch):
    class EP:
        name, value, dist = "broken", "broken_mod:plugin", types.SimpleNamespace(name="broken-dist")

        def load(self):
            raise ImportError("no module named broken_mod")

    monkeypatch.setattr(goose.manager.metadata, "entry_points", lambda group: [EP()])
    with pytest.warns(goose.PluginWarning) as rec:
        goose.manager.get_plugin_manager()
    msg = str(rec[0].message)
    assert "'broken'" in msg and "broken-dist" in msg and "GOOSE_DISABLE_PLUGIN_AUTOLOAD" in msg
    # left out alone: the others compose, and the broken one is listed and named in unknown-name errors
    assert "broken" in goose.broken_plugins()
    out = goose.compose(ToyCausalLM(), None, sources=["pld"], policy="chain").generate([1, 2, 3], max_new_tokens=4)
    assert len(out.token_ids) == 4
    with pytest.raises(goose.UnknownComponentError, match=r"Plugins left out .*broken: entry point 'broken_mod:plugin'"):
        goose.compose(ToyCausalLM(), None, sources=["broken-source"])


def test_an_installed_plugin_with_a_malformed_component_is_left_out_whole(monkeypatch):
    """An entry-point plugin that registers one good and one abstract source: neither is registered,
    a warning says why, and every other plugin's components compose (the abstract one poisoned
    every compose before)."""
    class Good(_Echo):
        name = "good-half"

    def reg(register):
        register(Good)
        register(goose.DraftSource, name="abstract-half")

    class EP:
        name, value, dist = "half", "half_mod:plugin", types.SimpleNamespace(name="half-dist")

        def load(self):
            return _plugin(goose_register_sources=reg)

    monkeypatch.setattr(goose.manager.metadata, "entry_points", lambda group: [EP()])
    with pytest.warns(goose.PluginWarning, match=r"left plugin 'half' out: .*without implementing: propose"):
        names = goose.get_registry().names("source")
    assert "good-half" not in names and "abstract-half" not in names and "pld" in names
    assert len(goose.compose(ToyCausalLM(), None, sources=["pld", "tr"], policy="spine").generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_autoload_can_be_disabled(monkeypatch):
    class EP:
        name, value, dist = "broken", "broken_mod:plugin", None

        def load(self):
            raise AssertionError("must not be loaded")

    monkeypatch.setattr(goose.manager.metadata, "entry_points", lambda group: [EP()])
    monkeypatch.setenv("GOOSE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "pld" in goose.get_registry().names("source")
    goose.manager.reset()
    monkeypatch.delenv("GOOSE_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("GOOSE_PLUGINS", "someone-else")  # allow-list without 'broken'
    assert "pld" in goose.get_registry().names("source")


def test_source_that_raises_is_named():
    class Boom(goose.DraftSource):
        name = "boom"

        def propose(self, state):
            raise RuntimeError("kaput")

    dec = goose.compose(ToyCausalLM(), None, sources=[Boom()], policy="chain")
    with pytest.raises(goose.DraftSourceError) as ei:
        dec.generate([1, 2, 3], max_new_tokens=4)
    assert "'boom'" in str(ei.value) and "kaput" in str(ei.value)
    # the decoder is still usable afterwards: nothing was lost
    dec2 = goose.compose(ToyCausalLM(), None, sources=["pld"])
    assert len(dec2.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_observer_hooks_are_called_per_step_and_generation():
    seen = {"start": 0, "step": 0, "end": 0, "committed": []}

    class Obs:
        @goose.hookimpl
        def goose_on_generation_start(self, decoder, request):
            seen["start"] += 1

        @goose.hookimpl
        def goose_on_step(self, decoder, step):
            seen["step"] += 1
            seen["committed"].extend(step.committed)

        @goose.hookimpl
        def goose_on_generation_end(self, decoder, output):
            seen["end"] += 1
            seen["out"] = output

    goose.register_plugin(Obs(), name="observer")
    out = goose.compose(ToyCausalLM(), None, sources=["pld"]).generate([1, 2, 3, 1, 2, 3], max_new_tokens=20)
    assert seen["start"] == seen["end"] == 1
    assert seen["step"] == out.stats.steps
    # the first token comes from the prefill; every later one is reported by exactly one step
    assert out.token_ids[1:] == seen["committed"]


@pytest.mark.skipif(not EXAMPLE_INSTALLED, reason="pip install ./docs/examples/goose-example-source")
class TestExamplePluginProject(SourceLosslessnessKit):
    max_examples = 25

    def make_source(self):
        return "last-successor"

    def test_discovered_through_entry_point(self):
        e = goose.get_registry().get("source", "last-successor")
        assert e.provider == "example" and "goose-example-source" in e.origin

    def test_accepts_drafts_on_repetitive_text(self):
        out = self._run([1, 2, 3, 4] * 6, 40, 10, None)
        assert out.stats.per_source.get("last-successor", {}).get("drafted", 0) > 0


@pytest.mark.skipif(not EXAMPLE_INSTALLED, reason="pip install ./docs/examples/goose-example-source")
class TestExamplePolicy(PolicyLosslessnessKit):
    """The example project's tree policy, installed, through the policy kit."""

    max_examples = 15

    def make_policy(self):
        return "longest-chain"

    def test_discovered_through_entry_point(self):
        e = goose.get_registry().get("policy", "longest-chain")
        assert e.provider == "example" and "goose-example-source" in e.origin


@pytest.mark.skipif(not EXAMPLE_INSTALLED, reason="pip install ./docs/examples/goose-example-source")
class TestExampleVerifier(VerifierLosslessnessKit):
    """The example project's verifier, installed, through the verifier kit; composed with its policy and
    sources on the toy, as greedy and with its own statistics."""

    max_examples = 10

    def make_verifier(self):
        return "tree-sizes"

    def test_discovered_and_composed_with_the_projects_policy_and_sources(self):
        e = goose.get_registry().get("verifier", "tree-sizes")
        assert e.provider == "example" and "goose-example-source" in e.origin
        model = ToyCausalLM()
        prompt = [1, 2, 3, 4] * 6
        dec = goose.compose(model, None, sources=["pld", "last-successor"], policy="longest-chain", verifier="tree-sizes")
        out = dec.generate(prompt, max_new_tokens=30)
        assert out.token_ids == goose.greedy(model).generate(prompt, max_new_tokens=30).token_ids
        sizes = out.stats.extra["verifier"]["tree_sizes"]
        assert sum(sizes.values()) == out.stats.steps and max(sizes) > 1, sizes


def test_every_hook_is_tested_and_documented():
    """An observer implementing every hook in goose.hookspecs sees each one called, with the arguments its
    spec documents; and docs/hooks.md shows every hook's exact signature."""
    specs = sorted(n for n in dir(goose.hookspecs) if n.startswith("goose_"))
    assert len(specs) == 6
    calls = {name: [] for name in specs}
    base = goose.get_registry()
    probes = {
        "goose_register_sources": ("source", base.get("source", "pld").cls),
        "goose_register_policies": ("policy", base.get("policy", "spine").cls),
        "goose_register_verifiers": ("verifier", base.get("verifier", "transformers").cls),
    }

    def registration(hookname):
        kind, cls = probes[hookname]

        def impl(register):
            calls[hookname].append(register)
            register(cls, name=f"hook-probe-{kind}", description="registered by the hook probe")

        impl.__name__ = hookname
        return impl

    def on_generation_start(decoder, request):
        calls["goose_on_generation_start"].append((decoder, request))

    def on_step(decoder, step):
        calls["goose_on_step"].append((decoder, step))

    def on_generation_end(decoder, output):
        calls["goose_on_generation_end"].append((decoder, output))

    probe = _plugin(
        goose_on_generation_start=on_generation_start,
        goose_on_step=on_step,
        goose_on_generation_end=on_generation_end,
        **{h: registration(h) for h in probes},
    )
    assert sorted(n for n in vars(probe) if n.startswith("goose_")) == specs, "the probe must implement every hook"
    goose.register_plugin(probe, name="hook-probe")

    # registration hooks: called once when the registry is built, with a working `register`
    reg = goose.get_registry()
    for hookname, (kind, cls) in probes.items():
        assert len(calls[hookname]) == 1, f"{hookname} called {len(calls[hookname])} times building the registry"
        assert callable(calls[hookname][0]), f"{hookname} was not given a register callable"
        e = reg.get(kind, f"hook-probe-{kind}")
        assert e.cls is cls and e.provider == "hook-probe", f"{hookname}: what the probe registered is not in the registry"

    # observer hooks: once per generation (start, end) and once per verification step
    model = ToyCausalLM()
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine")
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    out = dec.generate(prompt, max_new_tokens=24)
    assert len(out.token_ids) == 24

    starts = calls["goose_on_generation_start"]
    assert len(starts) == 1, f"goose_on_generation_start called {len(starts)} times for one generate"
    d, request = starts[0]
    assert d is dec and isinstance(request, goose.Request), "goose_on_generation_start(decoder, request) got wrong arguments"
    assert request.prompt_ids == tuple(prompt) and request.max_new_tokens == 24
    assert request.vocab_size == model.vocab_size and request.budget == dec.budget

    steps = calls["goose_on_step"]
    assert len(steps) == out.stats.steps > 0, f"goose_on_step called {len(steps)} times for {out.stats.steps} steps"
    assert all(d is dec for d, _ in steps)
    assert [s.step for _, s in steps] == list(range(out.stats.steps))
    committed = []
    for _, s in steps:
        assert isinstance(s, goose.StepRecord) and isinstance(s.tree, goose.DraftTree)
        assert isinstance(s.verified, goose.Verified) and s.verified.kind == "tree" and s.verified.tree is s.tree
        # the anchor is the last committed token; the step commits the accepted path plus the bonus
        assert s.tree.tokens[0] == (prompt + out.token_ids)[len(prompt) + len(committed)]
        assert s.committed == (*s.verified.accepted, s.verified.bonus)[: len(s.committed)] and s.committed
        assert s.draft_s >= 0 and s.verify_s >= 0
        committed.extend(s.committed)
    # the first token comes from the prefill; every later one is reported by exactly one step
    assert out.token_ids[1:] == committed, "goose_on_step's committed tokens are not what was generated"
    assert sum(len(s.verified.accepted) for _, s in steps) > 0, "no drafted token was accepted: a weak probe"

    ends = calls["goose_on_generation_end"]
    assert len(ends) == 1, f"goose_on_generation_end called {len(ends)} times for one generate"
    assert ends[0][0] is dec and ends[0][1] is out, "goose_on_generation_end(decoder, output) got wrong arguments"

    docs = (ROOT / "docs" / "hooks.md").read_text()
    for name in specs:
        assert calls[name], f"hook {name} was never called"
        sig = f"{name}{inspect.signature(getattr(goose.hookspecs, name))}".replace("'", "")
        assert sig in docs, f"docs/hooks.md must show the exact signature: {sig}"


def test_options_docs_are_up_to_date(monkeypatch):
    """docs/options.md is `goose plugins --options` for the built-ins, and says what a reader needs: every
    registered built-in component, every one of its options with its real default (the preset's value, the
    value a default_factory makes, or "required"), and never pydantic's `PydanticUndefined` sentinel."""
    from goose.tools.cli import options_markdown

    monkeypatch.setenv("GOOSE_DISABLE_PLUGIN_AUTOLOAD", "1")
    goose.manager.reset()
    have = (ROOT / "docs" / "options.md").read_text()
    assert "PydanticUndefined" not in have, "docs/options.md prints pydantic's sentinel instead of a default"
    # Each component's section, per kind ("## Tree policies", ...; a name may be a policy and a verifier):
    # from its "### `name`" heading to the next heading.
    parts = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", have, flags=re.M | re.S))
    reg = goose.manager.get_registry()
    for kind, title in (("source", "Draft sources"), ("policy", "Tree policies"), ("verifier", "Verifiers")):
        assert title in parts, f"docs/options.md has no '## {title}' part"
        sections = dict(re.findall(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", parts[title], flags=re.M | re.S))
        for name in reg.names(kind):
            e = reg.entries[kind][name]
            assert name in sections, f"docs/options.md has no section for the {kind} {name!r}"
            text = sections[name]
            if e.alias_of:
                said = "Deprecated name of" if e.deprecated else "Alias of"
                assert f"{said} `{e.alias_of}`." in text, f"{name!r}: {said.lower()} {e.alias_of!r} not stated"
                continue
            for field, info in e.cls.Options.model_fields.items():
                if field in e.defaults:
                    cell = f"`{e.defaults[field]!r}`"
                elif info.is_required():
                    cell = "required"
                elif info.default_factory is not None:
                    cell = f"`{info.default_factory()!r}`"
                else:
                    cell = f"`{info.default!r}`"
                row = f"| `{field}` | {cell.replace('|', chr(92) + '|')}"
                assert row in text, f"{kind} {name!r}, option {field!r}: docs/options.md lacks the row {row} ...|"
    want = options_markdown()
    assert have.strip() == want.strip(), "regenerate: GOOSE_DISABLE_PLUGIN_AUTOLOAD=1 goose plugins --options > docs/options.md"


class _NeverDrafts(goose.DraftSource):
    name = "never-drafts"

    def propose(self, state):
        return None


class _Mutates(goose.DraftSource):
    name = "mutates"

    def propose(self, state):
        state.tokens.append(1)


class _DuplicateSiblings(goose.DraftSource):
    name = "dup-siblings"

    def propose(self, state):
        return goose.Proposal(self.name, (1, 1), (-1, -1))


@pytest.mark.parametrize("source,test,error,match", [
    (_NeverDrafts, "test_proposals_are_drafted_and_valid", AssertionError, "never proposed"),
    (_Mutates, "test_lossless_on_toy", goose.DraftSourceError, "state.tokens is read-only"),
    (_Mutates, "test_generations_on_one_decoder", goose.DraftSourceError, "state.tokens is read-only"),
    (_DuplicateSiblings, "test_proposals_are_drafted_and_valid", goose.DraftSourceError, "duplicate siblings"),
    (_DuplicateSiblings, "test_sampling_is_seed_identical", goose.DraftSourceError, "duplicate siblings"),
])
def test_the_kit_fails_a_bad_source(source, test, error, match):
    class Kit(SourceLosslessnessKit):
        max_examples = 3

        def make_source(self):
            return source()

    with pytest.raises(error, match=match):
        getattr(Kit(), test)()


def test_the_kit_composes_with_its_policy_options():
    """``policy_options`` reach the policy the kit composes: a malformed option is refused at compose
    time, and a valid one (spine-fit on a fixed latency, a tiered start for the source) runs the checks."""

    class Kit(SourceLosslessnessKit):
        policy = "spine-fit"
        extra_sources = ("tr",)
        max_examples = 3

        def make_source(self):
            return _RightChain()

    bad = Kit()
    bad.policy_options = {"source_priors": {"pld": [(1.0, 1.5, 0.9)]}}
    with pytest.raises(goose.InvalidInputError, match="source_priors"):
        bad.test_proposals_are_drafted_and_valid()
    good = Kit()
    good.policy_options = {"latency": {1: 1.0, 128: 1.0}, "source_priors": {"right": [(0.0, 0.9, 0.95)]}}
    good.test_proposals_are_drafted_and_valid()
    good.test_lossless_on_toy()
    assert good._decoder().policy.options.source_priors == {"right": [(0.0, 0.9, 0.95)]}


class _RightChain(goose.DraftSource):
    """The toy model's own next 8 tokens, confidence 1.0."""

    name = "right"

    def propose(self, state):
        from goose.testing import reference_greedy

        return goose.Proposal.chain(self.name, reference_greedy(list(state.tokens), 8, 16), confidence=1.0)


def test_the_built_in_options_are_few_and_each_says_why(monkeypatch):
    """At most 60 option fields across the built-in components and the vLLM proposer, each with the reason a user
    would set it (``json_schema_extra["why"]``, printed in docs/options.md)."""
    from goose.vllm.options import ProposerOptions

    monkeypatch.setenv("GOOSE_DISABLE_PLUGIN_AUTOLOAD", "1")
    goose.manager.reset()
    reg = goose.manager.get_registry()
    classes = {e.cls.Options for kind in ("source", "policy", "verifier") for e in reg.entries[kind].values()}
    fields = [(c.__name__, f, i) for c in (*classes, ProposerOptions) for f, i in c.model_fields.items()]
    assert len(fields) <= 60, len(fields)
    assert [(c, f) for c, f, i in fields if not (i.json_schema_extra or {}).get("why")] == []
    goose.manager.reset()
