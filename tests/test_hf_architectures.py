"""Layer 2a: stock Hugging Face architectures (tiny, randomly initialised, float64).

Arbitrary draft trees verified through the unmodified Llama, Qwen2 and Gemma-3 modeling code must
reproduce ``model.generate(do_sample=False)`` token for token. Float64 keeps random-weight logits
far from ties. The trees mix tokens of the true greedy continuation (so deep paths get accepted
and committed) with random tokens.
"""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.testing.kit import ReferenceTreeSource

V = 97


def tiny(arch: str, attn: str = "sdpa"):
    import transformers as tf

    common = dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    cfg._attn_implementation = attn
    model = cls(cfg).to(torch.float64).eval()
    return model


_MODELS = {}


def get(arch, attn="sdpa"):
    if (arch, attn) not in _MODELS:
        _MODELS[arch, attn] = tiny(arch, attn)
    return _MODELS[arch, attn]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def RefTreeSource(ref_full, seed, p):
    return ReferenceTreeSource(ref_full, seed, p, V, p_chain=0.4)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gemma3", "sdpa")])
@settings(max_examples=12, deadline=None)
@given(
    prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=20),
    n=st.integers(1, 30),
    budget=st.integers(2, 20),
    seed=st.integers(0, 2**31),
    p=st.sampled_from([0.5, 0.9]),
)
def test_arbitrary_trees_equal_hf_generate(arch, attn, prompt, n, budget, seed, p):
    if arch == "gemma3":  # inside its sliding window (64); past it: tests/test_sliding_window.py
        prompt, n, budget = prompt[:16], min(n, 30), min(budget, 16)
    model = get(arch, attn)
    ref = hf_greedy(model, prompt, n)
    src = RefTreeSource(prompt + ref, seed, p)
    out = goose.compose(model, None, sources=[src], policy="proposal", budget=budget).generate(prompt, max_new_tokens=n)
    assert out.token_ids == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pld_chain_equals_hf_generate(arch):
    model = get(arch)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    ref = hf_greedy(model, prompt, 40)
    out = goose.compose(model, None, sources=["pld"], policy="chain").generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref


def test_gemma3_beyond_its_sliding_window_equals_hf_generate():
    """Past the window its sliding layers get windowed tree masks (more in tests/test_sliding_window.py)."""
    model = get("gemma3")
    prompt = list(range(40))
    ref = hf_greedy(model, prompt, 30)
    out = goose.compose(model, None, sources=["pld"], budget=8).generate(prompt, max_new_tokens=30)
    assert out.token_ids == ref
