"""Options that name sources are honoured at every level, and unused sources are not silent (issue 21, point 2).

``spine_source`` set once on the outer policy reaches every policy it wraps (``spine`` = bypass
around ``spine-tree``; ``spine-fit`` = fit around ``spine``), so the bypass and the tree read the
same chain; set differently at two levels it is an error. A composed source that the policy can
never consult gives a ``CompositionWarning`` at compose time.
"""

import warnings

import pytest

import goose
from goose.compose import CompositionWarning
from goose.testing import ToyCausalLM, reference_greedy

V = 16
FLAT = {"latency": {1: 1.0, 64: 1.0}}


class Echo(goose.DraftSource):
    """A chain source: repeats what followed the anchor's last earlier occurrence."""

    name = "echo"

    def __init__(self, options=None):
        super().__init__(options)
        self.calls = 0

    def propose(self, state):
        self.calls += 1
        toks = state.tokens
        a = toks[-1]
        for i in range(len(toks) - 2, -1, -1):
            if toks[i] == a:
                more = list(toks[i + 1:i + 6])
                return goose.Proposal.chain(self.name, more, confidence=0.5) if more else None
        return None


class Other(Echo):
    name = "other"


def _spines(policy):
    """Every (policy name, spine source) down the wrapping chain."""
    out = []
    while policy is not None:
        if hasattr(policy, "_spine"):
            out.append((type(policy).__name__, policy._spine))
        policy = getattr(policy, "inner", None)
    return out


@pytest.mark.parametrize("policy,extra", [("spine", {}), ("spine-fit", FLAT), ("iso3", {})])
def test_spine_source_set_once_reaches_every_level(policy, extra):
    # other and echo draft the same chains at the same confidence and are measured alike, so unforced,
    # rank() breaks the tie by name and echo leads: only spine_source="other" can put other's chain first
    other, echo = Other(), Echo()
    trees = []

    class TreeRecorder:
        @goose.hookimpl
        def goose_on_step(self, decoder, step):
            trees.append(step.tree)

    goose.register_plugin(TreeRecorder(), name="tree-recorder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionWarning)
        dec = goose.compose(ToyCausalLM(V, max_positions=128), None, sources=[other, echo, "tr"], policy=policy,
                            policy_options={"spine_source": "other", **extra})
    spines = _spines(dec.policy)
    assert spines and all(s == "other" for _, s in spines), spines
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3]
    out = dec.generate(prompt, max_new_tokens=24)
    assert out.token_ids == reference_greedy(prompt, 24, V)
    assert other.calls > 0 and echo.calls > 0
    # every level put other's chain on the spine: each spine node of every verified tree is credited to other
    # first (the leader vouches first); echo's chain is merged in beside it (it vouches too), not dropped
    spine_nodes = [t.credited(i) for t in trees for i in range(1, t.num_nodes) if t.origins[i] == "lead"]
    assert spine_nodes, f"{policy}: no spine node drafted"
    assert all(c[0] == "other" for c in spine_nodes), (policy, spine_nodes)
    assert any("echo" in c for c in spine_nodes) and out.stats.per_source["echo"]["drafted"] > 0, out.stats.per_source
    # the spine policies also count each cycle's leader; iso3 (IsotropicPolicy) reports no spine_leaders (its
    # stats() gives source_rates only), which is why this was skipped for it: the trees above are its check
    if policy != "iso3":
        leaders = out.stats.extra["policy"]["spine_leaders"]
        assert set(leaders) == {"other"}, leaders


def test_spine_source_set_twice_differently_is_an_error():
    with pytest.raises(goose.InvalidInputError, match=r"spine_source='echo' and inner_options spine_source='pld' disagree.*set spine_source once"):
        goose.compose(ToyCausalLM(V), None, sources=["pld", Echo(), "tr"], policy="spine",
                      policy_options={"spine_source": "echo", "inner_options": {"spine_source": "pld"}})
    with pytest.raises(goose.InvalidInputError, match=r"spine_source='nope' is not among the decoder's sources"):
        goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="spine-fit",
                      policy_options={"spine_source": "nope", **FLAT})
    with pytest.raises(goose.InvalidInputError, match=r"inner policy 'tr-tree' has no spine"):
        goose.compose(ToyCausalLM(V), None, sources=["tr"], policy="fit",
                      policy_options={"inner": "tr-tree", "spine_source": "tr", **FLAT})


@pytest.mark.parametrize("policy,extra", [("tr-tree", {}), ("chain", {"source": "pld"}), ("proposal", {"source": "echo"})])
def test_a_source_the_policy_never_consults_is_warned_about(policy, extra):
    with pytest.warns(CompositionWarning, match=r"never consults source\(s\) \['(echo|pld)'.*Hint: drop the unused source"):
        goose.compose(ToyCausalLM(V), None, sources=["pld", Echo(), "tr"], policy=policy, policy_options=extra or None)


@pytest.mark.parametrize("policy,extra", [("spine", {}), ("spine-fit", FLAT), ("iso3", {}), ("chain", {})])
def test_the_merging_policies_consult_every_source(policy, extra):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompositionWarning)
        goose.compose(ToyCausalLM(V), None, sources=["pld", Echo(), "tr"], policy=policy, policy_options=extra or None)


def test_no_warning_where_every_source_is_used():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompositionWarning)
        goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="spine")
        goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="spine-fit", policy_options=FLAT)
        goose.compose(ToyCausalLM(V), None, sources=["pld", Echo()], policy="chain")  # chain falls back in order
        goose.compose(ToyCausalLM(V), None, sources=["tr"], policy="tr-tree")
