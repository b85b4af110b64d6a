"""Goose's own ``generate`` resolves unset arguments exactly as ``model.generate`` does (issue 20).

A tiny stock Llama (random weights, float64, vocabulary 300 so that transformers' default
``top_k=50`` cuts into it) saved with a ``generation_config.json`` that sets sampling and a
repetition penalty, loaded back with ``from_pretrained``. Under the same seed, with only the
arguments a user gives both, ``Decoder.generate`` must equal ``model.generate`` token for token,
and so must ``custom_generate=goose.hf_generate``. Each case also checks that the default it
relies on is visible in the output (the same call with that default overridden draws other
tokens), so a Goose that dropped or hard-coded a default would fail here.
"""

import pytest
import torch

import goose

V = 300
SCALE = 4.0  # lm_head x4: rows peaked enough that greedy and draws differ, flat enough that top_k=50 cuts
NEW = 24
SEEDS = (0, 1, 2, 3)


def _tiny(tmp_path, **gen):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # sharper rows than a fresh init, so that draws and greedy differ per seed
        model.lm_head.weight.mul_(SCALE)
    model.generation_config = tf.GenerationConfig(pad_token_id=0, **gen)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa").eval()
    return loaded


PROMPT = [5, 17, 42, 17, 42, 99, 5, 17, 42, 8, 250, 3]


def _hf(model, n=NEW, seed=0, **kw):
    ids = torch.tensor([PROMPT])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kw)
    return out[0, len(PROMPT):].tolist()


def _goose(dec, n=NEW, seed=0, **kw):
    torch.manual_seed(seed)
    return dec.generate(torch.tensor(PROMPT), max_new_tokens=n, **kw)


def _both_equal(model, dec, **kw):
    """Goose's own generate and custom_generate equal model.generate for every seed; returns the outputs."""
    outs = []
    for seed in SEEDS:
        want = _hf(model, seed=seed, **kw)
        got = _goose(dec, seed=seed, **kw)
        assert got.token_ids == want, (seed, kw)
        assert _hf(model, seed=seed, custom_generate=goose.hf_generate, **kw) == want, (seed, kw)
        outs.append(want)
    return outs, got


def test_transformers_defaults_apply_when_only_temperature_and_top_p_are_given(tmp_path):
    """The issue's case: do_sample=True, temperature=0.7, top_p=0.9; transformers adds top_k=50."""
    model = _tiny(tmp_path)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine")
    kw = dict(do_sample=True, temperature=0.7, top_p=0.9)
    outs, got = _both_equal(model, dec, **kw)
    g = got.stats.extra["generation"]
    assert g["from"] == "transformers" and g["top_k"] == 50 and g["temperature"] == 0.7
    assert g["processors"] == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    # the default is visible: without the top-k cut, some seed draws other tokens
    no_cut = [_hf(model, seed=s, top_k=0, **kw) for s in SEEDS]
    assert no_cut != outs


def test_the_models_generation_config_applies_to_unset_arguments(tmp_path):
    model = _tiny(tmp_path, do_sample=True, temperature=1.3, top_k=7, top_p=0.85, repetition_penalty=1.2)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine")
    outs, got = _both_equal(model, dec)  # no argument at all: the model's config samples
    g = got.stats.extra["generation"]
    assert (g["do_sample"], g["temperature"], g["top_k"], g["top_p"], g["repetition_penalty"]) == (True, 1.3, 7, 0.85, 1.2)
    assert got.stats.extra["sampling"]["draws"] == NEW
    # each config value shows in the output: overriding it changes some seed's tokens
    for override in ({"top_k": 0}, {"temperature": 0.5}, {"repetition_penalty": 1.0}):
        assert [_hf(model, seed=s, **override) for s in SEEDS] != outs, override
    # given arguments win over the config, as in model.generate
    _both_equal(model, dec, top_k=0, temperature=0.9)
    # do_sample=False given: greedy with the config's repetition penalty, still equal
    greedy, got = _both_equal(model, dec, do_sample=False)
    assert got.stats.extra["generation"]["do_sample"] is False
    assert got.stats.extra["generation"]["processors"] == ["RepetitionPenaltyLogitsProcessor"]


def test_a_greedy_config_with_a_penalty_is_not_plain_greedy(tmp_path):
    model = _tiny(tmp_path, repetition_penalty=1.5)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine")
    want = _hf(model)
    got = _goose(dec)
    assert got.token_ids == want and got.stats.extra["generation"]["processors"] == ["RepetitionPenaltyLogitsProcessor"]
    assert want != _hf(model, repetition_penalty=1.0)


def test_plain_models_keep_the_argmax_walk(tmp_path):
    """A config that sets nothing: the default is greedy decoding, run by the plain argmax walk."""
    model = _tiny(tmp_path)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine")
    got = _goose(dec)
    assert got.token_ids == _hf(model, do_sample=False)
    assert "sampling" not in got.stats.extra and got.stats.extra["generation"]["processors"] == []


def test_decoding_modes_from_the_config_that_goose_cannot_honour_are_refused(tmp_path):
    model = _tiny(tmp_path, num_beams=3)
    dec = goose.compose(model, None, sources=["pld"], policy="chain")
    calls = []
    h = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(goose.InvalidInputError, match=r"num_beams=3 \(given, or set in the model's generation_config\).*Hint"):
            dec.generate(torch.tensor(PROMPT), max_new_tokens=4)
    finally:
        h.remove()
    assert not calls
    model.generation_config.num_beams = 1  # what the hint says
    assert dec.generate(torch.tensor(PROMPT), max_new_tokens=4).token_ids == _hf(model, n=4)


def test_a_users_processor_merges_as_transformers_merges_it(tmp_path):
    """However transformers merges a user's processors with the ones it builds (5.24: the user's
    list first, its sampling warpers after, a TopK of each), Goose's own generate applies the same list."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TopKLogitsWarper

    model = _tiny(tmp_path)
    dec = goose.compose(model, None, sources=["pld"], policy="chain")
    procs = LogitsProcessorList([TopKLogitsWarper(5), MinPLogitsWarper(0.2)])
    kw = dict(do_sample=True, temperature=0.8, top_k=20, logits_processor=procs)
    _, got = _both_equal(model, dec, **kw)
    assert {"TemperatureLogitsWarper", "TopKLogitsWarper", "MinPLogitsWarper"} <= set(got.stats.extra["generation"]["processors"])
    assert [_hf(model, seed=s, **{**kw, "logits_processor": None}) for s in SEEDS] != [_hf(model, seed=s, **kw) for s in SEEDS]
