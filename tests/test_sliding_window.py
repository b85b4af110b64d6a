"""Sliding-window models past the window (issue 24): Gemma-3 and the like, exact at any length.

Stock tiny random-weight models (Gemma-3 with sliding and full layers, window 8; Qwen2 with
``use_sliding_window``; Mistral, all layers sliding) on prompts and generations several windows
long, with draft trees that straddle the window and trees deeper than what a sliding layer holds:
Goose's output equals ``model.generate`` (greedy, and sampling under one seed) token for token.
Around that: the transformers behaviour the commit relies on (a sliding cache layer that keeps a
pass's rows until ``crop``), the windowed tree mask against transformers' own sliding mask, the
cache after each commit against one-token decoding's cache, a fault-injection test (a mask that
forgets the window must break the equality), the refusal that remains, and the real
Gemma-3-270M on a prompt of ~800 tokens (skipped when it is not pulled; GOOSE_REQUIRE_MODELS=1
turns that into a failure).
"""

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.testing import ToyCausalLM, reference_greedy
from goose.testing.kit import ReferenceTreeSource
from goose.tree import DraftTree
from goose.verifiers import attention
from goose.verifiers.transformers_tree import TransformersVerifier, TreeVerifierOptions

V = 128
W = 8  # the tiny models' sliding window
S, F = "sliding_attention", "full_attention"
REQUIRE = os.environ.get("GOOSE_REQUIRE_MODELS", "") == "1"


def tiny(arch: str = "gemma3", attn: str = "sdpa", dtype=torch.float32, window: int = W):
    import transformers as tf

    common = dict(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        initializer_range=0.1,
    )
    if arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, num_hidden_layers=3, head_dim=16, sliding_window=window, layer_types=[S, F, S])
        cls = tf.Gemma3ForCausalLM
    elif arch == "qwen2":  # layer 0 full, layers 1-2 sliding
        cfg = tf.Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True, sliding_window=window, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    elif arch == "mistral":  # every layer sliding, one mask for all
        cfg = tf.MistralConfig(**common, num_hidden_layers=2, sliding_window=window)
        cls = tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    cfg._attn_implementation = attn
    return cls(cfg).to(dtype).eval()


_MODELS: dict = {}


def get(arch="gemma3", attn="sdpa", dtype=torch.float32):
    if (arch, attn, dtype) not in _MODELS:
        _MODELS[arch, attn, dtype] = tiny(arch, attn, dtype)
    return _MODELS[arch, attn, dtype]


def hf_generate(model, prompt, n, **kw):
    ids = torch.tensor([prompt])
    kw = {"do_sample": False, **kw}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def repetitive_prompt(seed: int, length: int) -> list[int]:
    """Random segments, some repeated: prompt lookup and token recycling find drafts in it."""
    rng = random.Random(seed)
    seg = [rng.randrange(V) for _ in range(rng.randint(4, 9))]
    out: list[int] = []
    while len(out) < length:
        out += seg if rng.random() < 0.6 else [rng.randrange(V) for _ in range(rng.randint(2, 6))]
    return out[:length]


def RefTreeSource(ref_full, seed, p):
    return ReferenceTreeSource(ref_full, seed, p, V, p_chain=0.6)


class TrueChainSource(goose.DraftSource):
    """The true continuation as one long chain, with a wrong sibling at its root: every tree is
    accepted to its end through a gather (the accepted path is not a prefix of the layout)."""

    name = "true-chain"

    def __init__(self, ref_full):
        super().__init__()
        self.ref = ref_full

    def propose(self, state):
        seq = list(state.tokens)
        if seq != self.ref[: len(seq)]:
            return None
        chain = self.ref[len(seq): len(seq) + state.budget - 2]
        if not chain:
            return None
        wrong = (chain[0] + 1) % V
        return goose.Proposal(self.name, (wrong, *chain), (-1, -1, *range(1, len(chain))))


# ---- the transformers behaviour the commit relies on --------------------------------------------
def test_transformers_sliding_layer_keeps_rows_until_crop_and_then_the_last_window():
    """DynamicSlidingWindowLayer with past recording: ``update`` keeps every row, ``crop(-k)``
    drops k trailing rows and keeps the last window - 1, ``crop(0)`` only trims, and
    ``get_mask_sizes`` reports the held rows and their first position. verifiers/cache.py and the
    verifier's commit rely on exactly this; a transformers change to it fails here first."""
    from transformers import DynamicCache

    from goose.verifiers import cache as kv_cache

    model = get()
    cache = DynamicCache(config=model.config)
    kv_cache.keep_rows_for_rollback(cache)
    layer = cache.layers[0]
    assert type(layer).__name__ == "DynamicSlidingWindowLayer" and layer.sliding_window == W

    def rows(positions):  # a row's value is its position: what the layer holds is readable
        t = torch.tensor(positions, dtype=torch.float32).view(1, 1, -1, 1)
        return t, t.clone()

    committed: list[int] = []
    rng = random.Random(0)
    for step in range(40):
        n = rng.choice([1, 2, 5, W - 1, W, W + 3, 2 * W + 1])  # a pass of n rows (a tree of n nodes)
        past = len(committed)
        held = min(past, W - 1)
        if step:  # the sizes a mask is built from, before the pass
            assert layer.get_mask_sizes(n) == (held + n, past - held)
        pass_rows = list(range(1000 * (step + 1), 1000 * (step + 1) + n))
        k, v = layer.update(*rows(pass_rows))
        assert k[0, 0, :, 0].tolist() == committed[past - held:] + pass_rows  # what attention sees
        assert layer.keys.shape[-2] == held + n  # every row kept: kv_cache.pass_rows_start
        assert kv_cache.pass_rows_start(layer, n) == held
        accept = rng.randint(1, n)
        # the commit: gather (here the accepted rows are a prefix), crop the rest
        layer.crop(-(n - accept))
        committed += pass_rows[:accept]
        assert layer.get_seq_length() == len(committed)
        assert layer.keys[0, 0, :, 0].tolist() == committed[-(W - 1):]
        assert layer.values[0, 0, :, 0].tolist() == committed[-(W - 1):]


def test_windowed_tree_mask_on_a_chain_is_transformers_sliding_mask():
    """On a chain (a plain chunk of tokens) the windowed tree mask equals the mask transformers
    builds for its sliding layers, for caches below, at and past the window."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask

    model = get(attn="eager")
    cfg = model.config
    for past in (0, 3, W - 2, W - 1, W, W + 1, 3 * W + 5):
        cache = DynamicCache(config=cfg)
        cache.activate_past_recording()
        if past:
            with torch.inference_mode():
                model(input_ids=torch.arange(past).view(1, -1) % V, cache=cache, use_cache=True)
            cache.crop(0)
        for n in (2, 3, W, W + 2, 2 * W + 1):
            embeds = torch.zeros(1, n, cfg.hidden_size)
            pos = torch.arange(past, past + n).view(1, -1)
            theirs = create_sliding_window_causal_mask(cfg, embeds, None, cache, pos, allow_is_causal_skip=False)
            kv_len, kv_off = cache.get_mask_sizes(n, 0)
            chain = DraftTree.from_chain(1, [2] * (n - 1), "x")
            ours = attention.sliding_tree_mask(chain, past, W, kv_len - n)
            assert kv_off + kv_len - n == past
            see_theirs = theirs if theirs.dtype == torch.bool else theirs == 0
            assert torch.equal(see_theirs[0, 0], ours[0, 0] == 0), (past, n)


def test_windowed_tree_mask_on_a_tree():
    """Each node sees the held positions and the ancestors within the window of its own position."""
    parents = (-1, 0, 0, 2, 3, 3, 5, 6, 7, 8, 9, 10)
    tree = DraftTree.build(list(range(len(parents))), parents, "x")
    past, held, window = 20, 3, 4
    see = attention.sliding_tree_mask(tree, past, window, held)[0, 0] == 0
    for i, d in enumerate(tree.depths):
        q = past + d
        for c, k in enumerate(range(past - held, past)):
            assert bool(see[i, c]) == (k > q - window)
        anc = {i}
        while min(anc) > 0:
            anc.add(tree.parents[min(anc)])
        for j, dj in enumerate(tree.depths):
            assert bool(see[i, held + j]) == (j in anc and past + dj > q - window)


# ---- Goose equals transformers past the window ---------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@settings(max_examples=8, deadline=None)
@given(
    prompt_len=st.integers(1, 4 * W),
    n=st.integers(1, 5 * W),
    budget=st.integers(2, 3 * W),
    seed=st.integers(0, 2**31),
    p=st.sampled_from([0.6, 0.95]),
)
def test_arbitrary_trees_past_the_window_equal_generate(attn, prompt_len, n, budget, seed, p):
    model = get("gemma3", attn)
    prompt = repetitive_prompt(seed, prompt_len)
    ref = hf_generate(model, prompt, n)
    src = RefTreeSource(prompt + ref, seed, p)
    out = goose.compose(model, None, sources=[src], policy="proposal", budget=budget).generate(prompt, max_new_tokens=n)
    assert out.token_ids == ref


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_spine_past_the_window_equals_generate(attn):
    model = get("gemma3", attn)
    dec = goose.compose(model, tokenizer=None, sources=["pld", "tr"], policy="spine")
    drafted = 0
    for seed, plen in ((1, 3 * W), (2, 5 * W), (3, W - 1)):
        prompt = repetitive_prompt(seed, plen)
        ref = hf_generate(model, prompt, 6 * W)
        out = dec.generate(prompt, max_new_tokens=6 * W)
        assert out.token_ids == ref, seed
        drafted += sum(s["accepted"] for s in out.stats.per_source.values())
    assert drafted > 0  # trees were accepted, not only one-token steps


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "mistral"])
def test_trees_deeper_than_the_window_are_accepted_exactly(arch):
    """Chains of up to 3 windows of true tokens behind a wrong sibling: each pass holds more rows
    than a sliding layer keeps, every tree is accepted to its end through a gather, and the
    windowed masks ("dict" for Gemma-3 and Qwen2, "single" for Mistral) keep the output exact."""
    model = get(arch)
    assert attention.window_plan(model, model.config).mode == ("single" if arch == "mistral" else "dict")
    for plen, budget in ((2, W + 2), (W - 2, 3 * W), (2 * W + 3, 2 * W)):
        prompt = repetitive_prompt(plen, plen)
        ref = hf_generate(model, prompt, 6 * W)
        dec = goose.compose(model, None, sources=[TrueChainSource(prompt + ref)], policy="proposal", budget=budget)
        out = dec.generate(prompt, max_new_tokens=6 * W)
        assert out.token_ids == ref, (arch, plen, budget)
        assert max(out.stats.accept_lengths) >= min(budget - 2, 6 * W - 1) > W - 1


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_sliding_models_with_arbitrary_trees_equal_generate(arch):
    model = get(arch)
    for seed in range(3):
        prompt = repetitive_prompt(seed, 2 * W + seed)
        ref = hf_generate(model, prompt, 5 * W)
        src = RefTreeSource(prompt + ref, seed, 0.9)
        out = goose.compose(model, None, sources=[src], policy="proposal", budget=2 * W).generate(prompt, max_new_tokens=5 * W)
        assert out.token_ids == ref, (arch, seed)


def _true_chain_tree(anchor: int, chain: list[int]) -> DraftTree:
    """The root, a wrong first child (so the accepted path needs a gather), the chain, and a wrong
    leaf laid out before the chain's next node at its middle."""
    toks, pars = [anchor, (chain[0] + 1) % V], [-1, 0]
    prev = 0
    for j, t in enumerate(chain):
        toks.append(t)
        pars.append(prev)
        prev = len(toks) - 1
        if j == len(chain) // 2 and j + 1 < len(chain):
            toks.append((chain[j + 1] + 1) % V)
            pars.append(prev)
    return DraftTree.build(toks, pars, "x")


def test_cache_after_each_commit_equals_one_token_decoding():
    """After every commit, each layer holds exactly the rows plain decoding of the committed
    sequence holds (the sliding layers: the last window - 1 positions), with the same values, and
    counts the same positions: below the window, at the step it starts dropping rows, and past it,
    with trees deeper than the window and accepted paths that need a gather."""
    from transformers import DynamicCache

    model = get("gemma3", "sdpa", torch.float64)
    prompt = repetitive_prompt(7, W - 3)
    ref = hf_generate(model, prompt, 12 * W)
    v = TransformersVerifier(TreeVerifierOptions())
    v.bind(model)
    ver = v.prefill(torch.tensor(prompt))
    committed, anchor = list(prompt), int(ver.bonus)
    depths = [1, 2, 1, 3, W + 4, 2, 2 * W + 1, 1, W - 1, W, 2 * W, 5]
    for step, depth in enumerate(depths):
        at = len(committed) + 1 - len(prompt)  # the anchor is ref[at - 1]
        assert anchor == ref[at - 1]
        chain = list(ref[at: at + depth])
        if step % 3 == 2 and len(chain) > 2:  # a wrong token at depth 3: the rest of the pass is dropped
            chain[2] = (chain[2] + 2) % V
        tree = _true_chain_tree(anchor, chain)
        out = v.verify(tree)
        committed += [anchor, *out.accepted]
        anchor = int(out.bonus)
        assert v.past_len == len(committed)
        fresh = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([committed]), cache=fresh, use_cache=True)
        for i, (mine, theirs) in enumerate(zip(v.cache.layers, fresh.layers)):
            assert mine.get_seq_length() == theirs.get_seq_length() == len(committed), (step, i)
            assert mine.keys.shape == theirs.keys.shape, (step, i)
            assert torch.allclose(mine.keys, theirs.keys, rtol=0, atol=1e-9), (step, i)
            assert torch.allclose(mine.values, theirs.values, rtol=0, atol=1e-9), (step, i)
    assert len(committed) > 5 * W


def test_fault_a_mask_that_forgets_the_window_breaks_the_equality(monkeypatch):
    """The same runs with the sliding layers' tree mask made window-blind (every held position and
    every ancestor visible) must differ from transformers: the equality above is not vacuous."""
    model = get("gemma3")
    runs = []
    for plen in (2 * W, 3 * W + 1, W + 3):
        prompt = repetitive_prompt(plen, plen)
        ref = hf_generate(model, prompt, 6 * W)
        runs.append((prompt, ref))

    def generate(prompt, ref):
        dec = goose.compose(model, None, sources=[TrueChainSource(prompt + ref)], policy="proposal", budget=3 * W)
        return dec.generate(prompt, max_new_tokens=6 * W).token_ids

    assert all(generate(p, r) == r for p, r in runs)
    blind = attention.sliding_tree_mask
    monkeypatch.setattr(attention, "sliding_tree_mask", lambda tree, past, window, held, *a: blind(tree, past, 10**9, held, *a))
    assert any(generate(p, r) != r for p, r in runs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sampling_past_the_window_is_seed_identical_to_transformers(attn):
    model = get("gemma3", attn)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine")
    kw = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    for seed, plen in ((0, 3 * W), (1, 4 * W + 3)):
        prompt = repetitive_prompt(seed, plen)
        torch.manual_seed(seed)
        want = hf_generate(model, prompt, 6 * W, **kw)
        torch.manual_seed(seed)
        out = dec.generate(prompt, max_new_tokens=6 * W, **kw)
        assert out.token_ids == want, seed


# ---- what stays refused -------------------------------------------------------------------------
def test_window_goose_cannot_mask_is_refused_past_it_with_the_reason():
    """A model whose forward does not build its masks with transformers' masking utilities (here
    the exact toy given a window in its config): Goose cannot know the rule a windowed mask must
    reproduce, so it serves the model only inside the window and names why beyond."""
    m = ToyCausalLM(16)
    m.config.sliding_window = 32
    m.config.layer_types = [S]
    d = goose.compose(m, None, sources=["pld"], budget=8)
    with pytest.raises(goose.UnsupportedModelError, match=r"window 32\), and Goose cannot mask that window exactly.*"
                       r"create_sliding_window_causal_mask.*Allowed: at most 32 positions"):
        d.generate([1, 2, 3] * 5, max_new_tokens=20)
    assert d.generate([1, 2, 3], max_new_tokens=10).token_ids == reference_greedy([1, 2, 3], 10, 16)


def test_mixed_layers_under_a_single_mask_are_refused():
    """Sliding and full layers in a model that takes one mask for all: no tree mask fits both."""
    model = tiny("mistral")
    model.config.layer_types = [S, F]  # Mistral's forward takes one mask for every layer
    plan = attention.window_plan(model, model.config)
    assert plan.mode == "refuse" and "single attention mask" in plan.why


# ---- the real Gemma-3-270M ----------------------------------------------------------------------
PARAGRAPH = (
    "The harbour town woke slowly. Fishing boats came in with the tide, their hulls heavy with the "
    "night's catch, and the market stalls opened one after another along the quay. Merchants argued "
    "over the price of salt, children ran between the carts, and the old lighthouse keeper walked "
    "down the hill to buy bread as he had done every morning for forty years. "
)
CODE = '''
def moving_average(values, window):
    """Return the moving averages of values over a sliding window of the given size."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out

'''


@pytest.fixture(scope="module")
def gemma():
    from goose.tools import models

    if not models.installed().get("gemma-3-270m"):
        why = "Gemma-3-270M not pulled: run `goose models pull gemma-3-270m`"
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)
    return models.load("gemma-3-270m", "float32")


@pytest.mark.real_model
def test_gemma3_270m_past_its_window_equals_generate(gemma):
    """A prompt of ~800 tokens (window 512) ending on a question: greedy, and sampling under one seed."""
    model, tok = gemma
    assert model.config.sliding_window == 512
    text = tok((PARAGRAPH * 3 + CODE) * 4, return_tensors="pt")["input_ids"][0].tolist()[:760]
    ask = tok("\n\nIn one sentence, what does moving_average return, and who buys bread?\nAnswer:",
              add_special_tokens=False)["input_ids"]
    prompt = text + list(ask)
    assert 780 <= len(prompt) <= 820
    dec = goose.compose(model, tok, sources=["pld", "tr"], policy="spine")
    ref = hf_generate(model, prompt, 64)
    out = dec.generate(prompt, max_new_tokens=64)
    assert out.token_ids == ref
    assert sum(out.stats.accept_lengths) > 0  # drafts accepted past the window
    kw = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    torch.manual_seed(3)
    want = hf_generate(model, prompt, 64, **kw)
    torch.manual_seed(3)
    out = dec.generate(prompt, max_new_tokens=64, **kw)
    assert out.token_ids == want
