"""Inputs that used to slip through: a string or a bool for a number option, a tree's ``sources`` entry that is a bare
string or empty, a component whose constructor raises. Each is a Goose error naming the component (or the node), the
value, what is allowed and a hint."""

import types

import pytest
import torch
from pydantic import Field, field_validator

import goose
from goose.errors import DraftSourceError, InvalidInputError, InvalidTreeError, TreePolicyError, VerifierError
from goose.specs import check_method, preset
from goose.testing import ToyCausalLM
from goose.tools import models
from goose.tools.cli import main


def _plugin(**hooks):
    ns = types.SimpleNamespace()
    for name, fn in hooks.items():
        setattr(ns, name, goose.hookimpl(fn))
    return ns


# -- options: numbers and bools are taken as written -------------------------------------------------------
@pytest.mark.parametrize("value", ["3", " 3", b"3"])
def test_a_string_for_an_int_option_is_refused_with_the_component_and_value(value):
    with pytest.raises(InvalidInputError) as ei:
        goose.compose(ToyCausalLM(), None, sources=[("pld", {"max_chain": value})])
    msg = str(ei.value)
    assert "Invalid options for source 'pld'" in msg and "max_chain" in msg
    assert f"got {value!r} ({type(value).__name__})" in msg
    assert "allowed: an int >= 1 and <= 4096" in msg and "Hint:" in msg
    if isinstance(value, str):
        assert "max_chain: 3, the number itself" in msg


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_for_an_int_option_is_refused_saying_what_is_allowed(value):
    with pytest.raises(InvalidInputError) as ei:
        goose.compose(ToyCausalLM(), None, sources=[("pld", {"max_chain": value})])
    msg = str(ei.value)
    assert f"an integer is required, got {value!r} (bool)" in msg and "allowed: an int >= 1" in msg
    assert "Hint:" in msg


def test_a_float_option_takes_an_int_but_not_a_string_or_a_bool():
    dec = goose.compose(ToyCausalLM(), None, sources=[("suffix", {"min_prob": 1})])
    assert dec.sources[0].options.min_prob == 1.0
    for value in ("0.5", True):
        with pytest.raises(InvalidInputError) as ei:
            goose.compose(ToyCausalLM(), None, sources=[("suffix", {"min_prob": value})])
        msg = str(ei.value)
        assert "source 'suffix'" in msg and "min_prob" in msg and f"got {value!r}" in msg
        assert "a float or an int >= 0.0 and <= 1.0" in msg
    with pytest.raises(InvalidInputError, match=r"prior: .*a number is required, got '0.3' \(str\).*Hint: prior: 0.3"):
        goose.compose(ToyCausalLM(), None, sources=["pld", "tr"], policy="spine-fit", policy_options={"prior": "0.3"})


def test_the_items_of_a_tuple_or_dict_option_are_held_to_their_type():
    with pytest.raises(InvalidInputError, match=r"ngram_sizes: .*item \[1\]: an integer is required, got '3' \(str\)"):
        goose.compose(ToyCausalLM(), None, sources=[("pld", {"ngram_sizes": [4, "3"]})])
    with pytest.raises(InvalidInputError, match=r"item \['pld'\]\[0\]\[2\]: a number is required, got 'x'"):
        check_method('pld+tr/spine-fit{source_priors={"pld":[[1.0,0.6,"x"]]}}')
    check_method('pld+tr/spine-fit{source_priors={"pld":[[1,0.6,0.9]]},latency={"1":0.02}}')  # JSON keys stay strings


def test_a_plugin_options_class_is_held_to_the_same_rule():
    class Opts(goose.Options):
        count: int = Field(2, ge=1)
        rate: float | None = None
        either: int | str = 0

    assert Opts(count=3, rate=1, either="3").either == "3"  # a union that takes a str keeps it
    with pytest.raises(ValueError, match=r"an integer is required, got '3' \(str\); allowed: an int >= 1"):
        Opts(count="3")
    with pytest.raises(ValueError, match=r"a number is required, got False \(bool\)"):
        Opts(rate=False)


def test_method_spec_numbers_are_parsed_before_they_are_checked():
    kw = preset("pld{max_chain=3}+suffix{min_prob=1}/chain")
    assert kw["sources"] == [("pld", {"max_chain": 3}), ("suffix", {"min_prob": 1})]
    check_method("pld{max_chain=3}+suffix{min_prob=1}/chain")
    check_method("pld+tr/spine-fit{prior=1}")
    dec = goose.compose(ToyCausalLM(), None, **kw)
    assert dec.sources[0].options.max_chain == 3 and dec.generate([1, 2, 3, 1, 2], max_new_tokens=4).token_ids
    # true is a bool in a spec: not a number
    with pytest.raises(InvalidInputError, match=r"min_prob: .*a number is required, got True \(bool\)"):
        check_method("suffix{min_prob=true}/chain")


# -- tree sources ------------------------------------------------------------------------------------------
def test_a_bare_string_sources_entry_is_refused_naming_the_node():
    with pytest.raises(InvalidTreeError) as ei:
        goose.DraftTree.build([1, 2], [-1, 0], "branch", sources=[(), "pld"])
    msg = str(ei.value)
    assert msg.startswith("node 1: sources 'pld' is not allowed") and "characters" in msg and "Hint:" in msg
    with pytest.raises(InvalidTreeError, match=r"sources 'pld' is not allowed: one entry per node"):
        goose.DraftTree.build([1, 2], [-1, 0], "branch", sources="pld")


@pytest.mark.parametrize("entry, why", [
    ((), "an empty entry credits no source"),
    (("pld", "pld"), "a source is named twice"),
    (("pld", 3), "every name must be a non-empty str"),
    (("",), "every name must be a non-empty str"),
    (None, "a NoneType is not a collection of names"),
])
def test_a_drafted_node_needs_its_source_names(entry, why):
    with pytest.raises(InvalidTreeError) as ei:
        goose.DraftTree.build([1, 2, 3], [-1, 0, 1], "branch", sources=[(), ("tr",), entry])
    msg = str(ei.value)
    assert msg.startswith(f"node 2: sources {entry!r} is not allowed") and why in msg and "Hint:" in msg


def test_lists_and_frozensets_of_names_are_taken():
    tree = goose.DraftTree.build([1, 2, 3], [-1, 0, 1], "branch", sources=[[], ["pld"], frozenset({"tr", "pld"})])
    assert tree.sources == ((), ("pld",), ("pld", "tr"))
    assert tree.credited(2) == ("pld", "tr")
    assert goose.DraftTree.from_chain(1, [2, 3], "lead", source="pld").sources == ((), ("pld",), ("pld",))
    with pytest.raises(InvalidTreeError, match=r"from_chain: source \('pld',\) \(tuple\) is not allowed"):
        goose.DraftTree.from_chain(1, [2, 3], "lead", source=("pld",))


# -- components whose constructor raises ---------------------------------------------------------------------
class _BrokenSource(goose.DraftSource):
    name = "broken-source"

    def __init__(self, options=None):
        super().__init__(options)
        raise ValueError("no table for this source")

    def propose(self, state):
        return None


class _BrokenPolicy(goose.TreePolicy):
    name = "broken-policy"

    def __init__(self, options=None):
        super().__init__(options)
        raise ValueError("no table for this policy")

    def shape(self, ctx):
        return None


class _BrokenVerifier(goose.Verifier):
    name = "broken-verifier"

    def __init__(self, options=None):
        super().__init__(options)
        raise ValueError("no table for this verifier")

    def prefill(self, prompt_ids, keep=None):
        raise NotImplementedError

    def verify(self, tree):
        raise NotImplementedError


class _BindFailsPolicy(goose.TreePolicy):
    name = "bind-fails"

    def bind(self, sources):
        raise ValueError("needs a source named 'x'")

    def shape(self, ctx):
        return None


class _CheckedOptions(goose.Options):
    level: int = 1

    @field_validator("level")
    @classmethod
    def _level(cls, v):
        if v == 13:
            raise RuntimeError("unlucky level")
        return v


class _CheckedSource(goose.DraftSource):
    name = "checked-source"
    Options = _CheckedOptions

    def propose(self, state):
        return None


@pytest.fixture
def broken_plugin():
    """The throwaway components, registered as one plugin and removed afterwards: the registry is as it was."""
    reg = goose.get_registry()
    before = {k: reg.names(k) for k in ("source", "policy", "verifier")}
    goose.register_plugin(_plugin(
        goose_register_sources=lambda register: (register(_BrokenSource), register(_CheckedSource)),
        goose_register_policies=lambda register: (register(_BrokenPolicy), register(_BindFailsPolicy)),
        goose_register_verifiers=lambda register: register(_BrokenVerifier),
    ), name="broken-plugin")
    try:
        yield
    finally:
        goose.unregister_plugin("broken-plugin")
        reg = goose.get_registry()
        assert {k: reg.names(k) for k in ("source", "policy", "verifier")} == before


@pytest.mark.parametrize("kw, error, name", [
    ({"sources": ["broken-source"]}, DraftSourceError, "broken-source"),
    ({"sources": ["pld"], "policy": "broken-policy"}, TreePolicyError, "broken-policy"),
    ({"sources": ["pld"], "verifier": "broken-verifier"}, VerifierError, "broken-verifier"),
])
def test_a_constructor_that_raises_is_the_roles_error_naming_the_component(broken_plugin, kw, error, name):
    with pytest.raises(error) as ei:
        goose.compose(ToyCausalLM(), None, **kw)
    err = ei.value
    assert err.component == name and err.hook == "__init__"
    assert isinstance(err.__cause__, ValueError) and "no table for this" in str(err.__cause__)
    msg = str(err)
    assert repr(name) in msg and "__init__()" in msg and "ValueError: no table for this" in msg
    assert "Hint:" in msg and "'broken-plugin'" in msg


def test_an_options_validator_that_raises_is_the_roles_error(broken_plugin):
    assert goose.compose(ToyCausalLM(), None, sources=[("checked-source", {"level": 2})]).sources[0].options.level == 2
    with pytest.raises(DraftSourceError) as ei:
        goose.compose(ToyCausalLM(), None, sources=[("checked-source", {"level": 13})])
    assert ei.value.hook == "Options" and isinstance(ei.value.__cause__, RuntimeError)
    assert "'checked-source'" in str(ei.value) and "RuntimeError: unlucky level" in str(ei.value)


def test_check_method_builds_the_components_without_a_model(broken_plugin):
    with pytest.raises(TreePolicyError, match=r"Tree policy 'broken-policy' raised in __init__\(\): ValueError"):
        check_method("pld/broken-policy")
    check_method("pld/bind-fails")  # bind needs the model: checked by compose


@pytest.mark.parametrize("method, name", [("broken-source/chain", "broken-source"),
                                          ("pld/broken-policy", "broken-policy"),
                                          ("pld/chain/broken-verifier", "broken-verifier")])
def test_bench_refuses_a_method_that_cannot_be_built_before_loading_the_model(broken_plugin, capsys, method, name):
    rc = main(["bench", "--model", "no-such-model", "--datasets", "demo@1", "--methods", f"ar,{method}",
               "--no-plots", "--out", ""])
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc != 0 and "Traceback" not in cap.out + cap.err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"goose: error: method {method!r}: ") and repr(name) in err and "__init__()" in err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    if not models.installed()["smollm2"]:
        pytest.skip("SmolLM2 not pulled (its tokenizer is needed): run `goose models pull smollm2`")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(models.resolve("smollm2")))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_bench_names_the_method_when_bind_fails_after_the_model_loaded(broken_plugin, tiny_model_dir, capsys):
    rc = main(["bench", "--model", str(tiny_model_dir), "--datasets", "demo@1", "--max-new-tokens", "4",
               "--methods", "pld/bind-fails", "--threads", "1", "--warmup", "0", "--no-plots", "--out", ""])
    cap = capsys.readouterr()
    assert rc != 0 and "Traceback" not in cap.out + cap.err
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith("goose: error: method 'pld/bind-fails': Tree policy 'bind-fails' raised in bind()")
    assert "ValueError: needs a source named 'x'" in last
