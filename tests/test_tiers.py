"""goose.policies.tiers and ``goose tiers``: a chain source's acceptance per confidence tier, measured and stored."""

import json
import types

import pytest
import torch

import goose
from goose.policies import tiers
from goose.errors import InvalidInputError
from goose.testing.toy import ToyCausalLM, reference_greedy
from goose.tools.cli import main


def row(conf, n, accepted, left=64, prompt="1", pos=0):
    return dict(dataset="d", prompt=prompt, pos=pos, confidence=conf, n=n, accepted=accepted, left=left)


@pytest.fixture
def store(tmp_path, monkeypatch):
    d = tmp_path / "store"
    monkeypatch.setenv("GOOSE_TIERS_DIR", str(d))
    return d


# ---------------------------------------------------------------------------------------------
# summarize
# ---------------------------------------------------------------------------------------------
def test_deeper_counts_depth_d_only_where_d_minus_1_held_and_the_output_reaches_d():
    # 4 tokens, 2 right: depth 2 tried and hit, depth 3 tried and missed, depth 4 not tried
    assert tiers.deeper([row(1.0, 4, 2)]) == (1, 2)
    # the output ends after 2 tokens: depth 3 cannot be judged
    assert tiers.deeper([row(1.0, 4, 2, left=2)]) == (1, 1)
    # first token wrong: no deeper trial at all
    assert tiers.deeper([row(1.0, 4, 0)]) == (0, 0)


def test_p_1_counts_each_prompts_first_proposal_of_the_tier_only():
    rows = [row(1.0, 4, 4, pos=7), row(1.0, 4, 0, pos=2), row(1.0, 4, 4, pos=9),  # prompt 1: first (pos 2) missed
            row(1.0, 2, 2, prompt="2", pos=5)]  # prompt 2: held
    (t,), (m, m2) = tiers.summarize(rows, (1.0, 0.7))
    assert (m["floor"], m["proposals"], m["prompts"], m["p_1"]) == (1.0, 4, 2, 0.5)
    # p_deeper pools every proposal of the tier: 3 + 0 + 3 + 1 trials, all hits
    assert (m["p_deeper"], m["p_deeper_trials"]) == (1.0, 7)
    assert t == (1.0, round(tiers.wilson_lower(1, 2), 3), round(tiers.wilson_lower(7, 7), 3))
    # the 0.7 tier saw nothing: left out of the tiers, zeros in measured
    assert m2 == dict(floor=0.7, proposals=0, prompts=0, p_1=0.0, p_deeper=0.0, p_deeper_trials=0)


def test_a_proposal_joins_the_first_floor_its_confidence_reaches():
    rows = [row(1.0, 1, 1, prompt="a"), row(0.9, 1, 0, prompt="b"), row(0.7, 1, 0, prompt="c"),
            row(0.69, 1, 1, prompt="d")]
    got, measured = tiers.summarize(rows, (1.0, 0.7))
    assert [t.floor for t in got] == [1.0, 0.7]
    assert [(m["proposals"], m["p_1"]) for m in measured] == [(1, 1.0), (2, 0.0)]  # 0.69: no tier
    assert [t.floor for t in tiers.summarize(rows, (0.5,))[0]] == [0.5]
    assert tiers.tier_index(0.69, (1.0, 0.7)) is None and tiers.tier_index(0.95, (1.0, 0.7)) == 1


def test_the_wilson_bound_sits_below_the_rate_and_approaches_it_with_more_trials():
    bounds = [tiers.wilson_lower(8 * k, 10 * k) for k in (1, 10, 100, 1000)]
    assert all(b < 0.8 for b in bounds) and bounds == sorted(bounds)
    assert 0.8 - bounds[-1] < 0.01 and 0.8 - bounds[0] > 0.1
    assert tiers.wilson_lower(0, 0) == 0.0 and tiers.wilson_lower(5, 5) < 1.0
    assert tiers.wilson_lower(8, 10, z=0) == pytest.approx(0.8)
    # one-sided 90 % by default; a larger z is more pessimistic
    assert tiers.wilson_lower(8, 10, z=1.96) < tiers.wilson_lower(8, 10)
    (t,), _ = tiers.summarize([row(1.0, 2, 2, prompt=str(i)) for i in range(40)], (1.0,))
    assert t.p_1 == round(tiers.wilson_lower(40, 40), 3) < 1.0


@pytest.mark.parametrize("floors", [(0.7, 1.0), (1.0, 1.0), (1.2,), (-0.1,), (), ("x",)])
def test_floors_must_lie_in_0_1_and_fall(floors):
    with pytest.raises(InvalidInputError, match="strictly decreasing"):
        tiers.summarize([row(1.0, 1, 1)], floors)


def test_the_tables_put_each_proposal_in_its_tier_and_band():
    rows = [row(1.0, 10, 10), row(0.8, 10, 3, prompt="2"), row(0.2, 2, 0, prompt="3")]
    lines = tiers.by_depth(rows).splitlines()
    top = next(x for x in lines if x.startswith("| conf >= 1.0"))
    mid = next(x for x in lines if x.startswith("| 0.7 <= conf < 1.0"))
    # every depth 2..10 right; bands 2, 3-4, 5-8, 9-16 hold 1, 2, 4, 2 trials
    assert "1.000 (1) | 1.000 (2) | 1.000 (4) | 1.000 (2) | - | -" in top
    # right to depth 3: depth 2 hit, 3 hit, 4 missed, nothing deeper tried
    assert "1.000 (1) | 0.500 (2) | - |" in mid
    assert any(x.startswith("| conf < 0.7 (no tier)") for x in lines)
    table = tiers.table(rows, (1.0, 0.7))
    assert "| conf >= 1.0 | 1 | 1 | 1.000 (1/1) |" in table
    assert "| conf < 0.7 (no tier) | 1 | 1 | 0.000 (0/1) | - |" in table


# ---------------------------------------------------------------------------------------------
# load / save
# ---------------------------------------------------------------------------------------------
def record(source="mine", version="1", ts=((1.0, 0.8, 0.9), (0.5, 0.4, 0.85))):
    return {"source": source, "version": version, "model": "toy", "datasets": "demo", "max_new_tokens": 8,
            "tiers": [list(t) for t in ts], "measured": [], "z": 1.2816}


def test_save_then_load_round_trips_through_the_user_store(store):
    assert tiers.load("mine", "1", "toy") is None
    path = tiers.save(record())
    assert path == store / "mine@1@toy.json" and not list(store.glob("*.tmp"))
    assert tiers.load("mine", "1", "toy") == [(1.0, 0.8, 0.9), (0.5, 0.4, 0.85)]
    assert tiers.load("mine", "2", "toy") is None  # another version: measured apart
    assert tiers.load("mine", "1", "smollm2") is None  # another model: measured apart
    # a file written again is read again (nothing stale)
    tiers.save(record(ts=((0.9, 0.1, 0.2),)))
    assert tiers.load("mine", "1", "toy") == [(0.9, 0.1, 0.2)]


def test_tiers_are_kept_per_model(store):
    """The same source and version measured on two models: each model reads its own, a third none; a model
    object is looked up by its key; an older file without the model in its name is read for the model it names."""
    tiers.save(record(ts=((1.0, 0.8, 0.9),)))
    tiers.save({**record(ts=((1.0, 0.3, 0.6),)), "model": "smollm2"})
    assert tiers.load("mine", "1", "toy") == [(1.0, 0.8, 0.9)]
    assert tiers.load("mine", "1", "smollm2") == [(1.0, 0.3, 0.6)]
    assert tiers.load("mine", "1", "qwen2.5-coder-1.5b") is None
    toy = ToyCausalLM(VOCAB)
    tiers.save({**record(ts=((1.0, 0.7, 0.7),)), "model": tiers.model_key(toy)})
    assert tiers.load("mine", "1", toy) == [(1.0, 0.7, 0.7)]
    (store / "old@1.json").write_text(json.dumps({**record("old"), "model": "smollm2"}))
    assert tiers.load("old", "1", "smollm2") == [(1.0, 0.8, 0.9), (0.5, 0.4, 0.85)]
    assert tiers.load("old", "1", "toy") is None


def test_the_model_key(tmp_path):
    from types import SimpleNamespace

    folder = tmp_path / "smollm2"
    folder.mkdir()
    by = lambda where: SimpleNamespace(config=SimpleNamespace(name_or_path=where))  # noqa: E731
    assert tiers.model_key(by(str(folder))) == "smollm2"  # a local folder: its name
    assert tiers.model_key(by("HuggingFaceTB/SmolLM2-135M-Instruct")) == "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert tiers.model_key(ToyCausalLM(16)) != tiers.model_key(ToyCausalLM(32))  # no path: the architecture's sizes
    assert tiers.model_key("my model") == "my-model"
    with pytest.raises(InvalidInputError, match="gives no name"):
        tiers.model_key("")


def test_a_policy_reads_the_tiers_of_the_model_it_is_composed_on(store):
    """spine-fit and the merging policies start pld at the tiers measured with this model, and at the prior
    on a model with none."""
    model = ToyCausalLM(VOCAB)
    key = tiers.model_key(model)
    tiers.save({**record("pld", "1", ((1.0, 0.9, 0.95),)), "model": key})
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", policy_options={"latency": {1: 1.0, 128: 1.0}})
    assert dec.policy.priors == {"pld": [(1.0, 0.9, 0.95)]}
    assert dec.policy.inner.inner.rates.starts[("pld", 1.0)] == (0.9, 0.95)
    other = goose.compose(ToyCausalLM(VOCAB + 1), None, sources=["pld", "tr"], policy="spine")
    assert other.policy.inner.rates.starts == {}


def test_the_user_store_comes_before_the_shipped_file(store):
    shipped = tiers.load("pld", "1", "smollm2")
    tiers.save({**record("pld", "1", ((1.0, 0.5, 0.5),)), "model": "smollm2"})
    assert tiers.load("pld", "1", "smollm2") == [(1.0, 0.5, 0.5)] != shipped


def test_save_to_a_path(tmp_path, store):
    path = tiers.save(record(), tmp_path / "elsewhere" / "x.json")
    assert json.loads(path.read_text())["tiers"][0] == [1.0, 0.8, 0.9]
    assert tiers.load("mine", "1", "toy") is None


@pytest.mark.parametrize("text, what", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"tiers": 3}', '"tiers" is 3'),
    ('{"tiers": [[1.0, 1.2, 0.9]]}', "tier 0"),
    ('{"tiers": [[1.0, 0.5]]}', "tier 0"),
    ('{"tiers": [[0.5, 0.5, 0.5], [0.7, 0.5, 0.5]]}', "does not fall below"),
    ('{"source": "other", "tiers": []}', "'source' is 'other'"),
])
def test_a_malformed_file_is_named_with_what_is_wrong(store, text, what):
    store.mkdir(parents=True)
    (store / "mine@1@toy.json").write_text(text)
    with pytest.raises(InvalidInputError) as e:
        tiers.load("mine", "1", "toy")
    msg = str(e.value)
    assert "mine@1@toy.json" in msg and what in msg and "goose tiers --source mine" in msg


def test_names_that_would_leave_the_folder_are_refused(store):
    for name in ("../x", "a/b", "", ".hidden", "my@src"):
        with pytest.raises(InvalidInputError, match="cannot name a file"):
            tiers.save(record(source=name))
        assert tiers.load(name, "1", "toy") is None  # nothing can have been stored under it: no tiers
    with pytest.raises(InvalidInputError, match="tier 0"):
        tiers.save(record(ts=((2.0, 0.5, 0.5),)))
    assert not store.exists()


def test_the_shipped_pld_tiers_load(store):
    got = tiers.load("pld", goose.get_registry().get("source", "pld").cls.version, "smollm2")
    assert [t[0] for t in got] == [1.0, 0.7]
    assert all(0.0 <= x <= 1.0 for t in got for x in t)
    rec = json.loads((tiers.shipped_dir() / "pld@1@smollm2.json").read_text())
    assert rec["source"] == "pld" and rec["model"] == "smollm2" and rec["max_new_tokens"] == 64


# ---------------------------------------------------------------------------------------------
# measure, on exact toy models
# ---------------------------------------------------------------------------------------------
VOCAB = 16


class Oracle(goose.DraftSource):
    """Proposes the toy's true next ``right`` tokens, then one wrong token (as a chain, or a tree whose
    first chain it is)."""

    name = "oracle"
    right = 3
    tree = False

    def propose(self, state):
        toks = reference_greedy(list(state.tokens), self.right + 1, VOCAB)
        chain = toks[:-1] + [(toks[-1] + 1) % VOCAB]
        if not self.tree:
            return goose.Proposal.chain(self.name, chain, confidence=1.0 if state.step % 2 else 0.8)
        # a branch at the root first in line order after the chain's first node
        return goose.Proposal(self.name, (chain[0], (chain[0] + 1) % VOCAB, *chain[1:]),
                              (-1, -1, 0, *range(2, len(chain))), confidence=0.8)


def prompts(*ids_lists):
    return [types.SimpleNamespace(text=ids, dataset="toy", id=str(k)) for k, ids in enumerate(ids_lists)]


@pytest.mark.parametrize("tree", [False, True])
def test_measure_counts_what_the_greedy_output_continues_with(tree):
    src = Oracle()
    src.tree = tree
    ps = prompts([1, 2, 3, 4], [5, 6, 7])
    rows = tiers.measure(src, ToyCausalLM(VOCAB), None, ps, 10)
    assert len(rows) == 20 and {r["prompt"] for r in rows} == {"0", "1"}
    for r in rows:
        # 3 right then a wrong token; near the end the output runs out first
        assert (r["n"], r["left"], r["accepted"]) == (4, 10 - r["pos"], min(3, 10 - r["pos"]))
    if not tree:
        (t1, t7), _ = tiers.summarize(rows, (1.0, 0.7))
        assert t1.floor == 1.0 and t7.floor == 0.7


def test_measure_on_pld_and_a_transformers_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    src = goose.manager.build_component("source", "pld", goose.DraftSource, None)
    rows = tiers.measure(src, model, None, prompts([1, 2, 3, 1, 2, 3, 1, 2, 3] * 2), 24)
    assert rows and all(0 <= r["accepted"] <= r["n"] and r["left"] == 24 - r["pos"] for r in rows)
    # the toy takes the plain argmax loop; it is the toy's greedy output
    assert tiers._greedy(ToyCausalLM(VOCAB), [3, 1, 4], 12) == reference_greedy([3, 1, 4], 12, VOCAB)


def test_measure_refuses_a_successor_only_source():
    tr = goose.manager.build_component("source", "tr", goose.DraftSource, None)
    with pytest.raises(InvalidInputError, match="tiers are measured on a chain source's proposals"):
        tiers.measure(tr, ToyCausalLM(VOCAB), None, prompts([1, 2]), 4)


# ---------------------------------------------------------------------------------------------
# goose tiers
# ---------------------------------------------------------------------------------------------
class CharTokenizer:
    def __call__(self, text, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) % VOCAB for c in text[:120]]])}


@pytest.fixture
def toy_load(monkeypatch):
    from goose.tools import models

    calls = []

    def load(name, dtype="float32"):
        calls.append(name)
        return ToyCausalLM(VOCAB), CharTokenizer()

    monkeypatch.setattr(models, "load", load)
    return calls


def test_goose_tiers_measures_and_stores_where_load_finds_it(store, toy_load, capsys):
    args = ["tiers", "--source", "pld{max_chain=8}", "--model", "toy", "--datasets", "demo@3",
            "--max-new-tokens", "24", "--threads", "1", "--floors", "1.0,0.5,0.0"]
    assert main([*args, "--dry-run"]) == 0
    assert not store.exists() and "nothing written" in capsys.readouterr().out
    assert main(args) == 0
    out = capsys.readouterr().out
    key = tiers.model_key(ToyCausalLM(VOCAB))
    assert "| confidence tier |" in out and "p_d, d 3-4" in out and str(store / f"pld@1@{key}.json") in out
    rec = json.loads((store / f"pld@1@{key}.json").read_text())
    assert rec["source"] == "pld" and rec["version"] == "1" and rec["options"]["max_chain"] == 8
    assert rec["datasets"] == "demo@3" and rec["model"] == key and len(rec["measured"]) == 3
    assert tiers.load("pld", "1", ToyCausalLM(VOCAB)) == [tuple(t) for t in rec["tiers"]]
    assert toy_load == ["toy", "toy"]


class Never(goose.DraftSource):
    name = "never"

    def propose(self, state):
        return None if state.step >= 0 else goose.Proposal.chain(self.name, [1])


class Branches(goose.DraftSource):
    name = "branches-only"
    provides_successors = True

    def successors(self, token, prev):
        return (1,), (1.0,)


def _register(*classes):
    plugin = types.SimpleNamespace(goose_register_sources=goose.hookimpl(lambda register: [register(c) for c in classes]))
    goose.register_plugin(plugin, name="tiers-test")


def test_goose_tiers_refuses_a_source_that_proposed_nothing(store, toy_load, capsys):
    _register(Never)
    assert main(["tiers", "--source", "never", "--datasets", "demo@1", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "proposed nothing" in err and "nothing to store" in err and "Hint" in err and not store.exists()


@pytest.mark.parametrize("extra, words", [
    (["--source", "plld"], ["Unknown draft source 'plld'", "Did you mean 'pld'", "Hint: --source pld"]),
    (["--source", "tr"], ["tiers are measured on a chain source's proposals"]),
    (["--source", "branches-only"], ["tiers are measured on a chain source's proposals", "'branches-only'"]),
    (["--source", "pld+suffix"], ["one source at a time"]),
    (["--source", "pld/chain"], ["one source at a time"]),
    (["--source", "pld", "--floors", "0.7,1.0"], ["--floors 0.7,1.0", "strictly decreasing", "Hint: 1.0,0.7"]),
    (["--source", "pld", "--floors", "1.0,1.5"], ["--floors 1.0,1.5", "in [0, 1]"]),
    (["--source", "pld", "--floors", "high"], ["--floors 'high'", "numbers"]),
    (["--source", "pld", "--max-new-tokens", "0"], ["--max-new-tokens 0", "Hint"]),
])
def test_goose_tiers_refuses_bad_input_before_loading_a_model(store, toy_load, capsys, extra, words):
    _register(Branches)
    assert main(["tiers", *extra]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert toy_load == [] and not store.exists()
