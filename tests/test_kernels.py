"""The verifier's CPU kernels for tree passes: grouped-query attention read in place
(verifiers/attention.py), a cache that appends in place (verifiers/cache.py) and packed-weight
linear layers (verifiers/skinny.py). The first two must leave every logit unchanged to the bit;
the third computes the same products to float32 rounding and must stay lossless."""

import threading

import pytest
import torch

import goose
from goose.errors import UnsupportedModelError
from goose.tree import DraftTree
from goose.verifiers import attention, skinny
from goose.verifiers.cache import HeadroomLayer
from goose.verifiers.transformers_tree import TransformersVerifier, TreeVerifierOptions

from test_hf_architectures import get, hf_greedy, tiny


def _tree_logits(model, opts: dict, prompt, trees, commit_first: bool = True):
    """Logits of each tree pass in turn over one cache (committing the root of each)."""
    v = TransformersVerifier(TreeVerifierOptions(**opts))
    v.bind(model)
    v.prefill(torch.tensor(prompt), keep=1)
    out = []
    for toks, parents in trees:
        tree = DraftTree.build(toks, parents, "x")
        with torch.inference_mode():
            lg = v._forward(torch.tensor([tree.tokens]), tree.attention_mask(v.past_len, dtype=v.dtype),
                            tree.position_ids(v.past_len))
        out.append(lg.clone())
        v.commit(v.past_len, (0,), tree.num_nodes)  # keep the root, drop the rest (a crop)
        v.past_len += 1
    return out, v


TREES = [([5, 6, 7], [-1, 0, 0]), ([8, 9, 10, 11, 12], [-1, 0, 1, 0, 3]), ([13, 14], [-1, 0]),
         ([15] + list(range(20, 90)), [-1] + [0] * 70)]  # the last outgrows the first headroom


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gqa_in_place_and_headroom_leave_every_logit_unchanged(arch, monkeypatch):
    from goose.verifiers import cache

    monkeypatch.setattr(cache, "MIN_ROOM", 8)  # small buffers: the passes below reallocate them
    model = get(arch)
    assert getattr(model.model.layers[0].self_attn, "num_key_value_groups", 1) > 1  # the case that copied
    prompt = list(range(1, 40))
    trees = TREES if arch != "gemma3" else TREES[:3]  # gemma3's sliding window is 64 positions
    stock, _ = _tree_logits(model, {"gqa": False, "headroom": False}, prompt, trees)
    fast, v = _tree_logits(model, {"gqa": True, "headroom": True}, prompt, trees)
    assert v._gqa
    assert any(isinstance(layer, HeadroomLayer) for layer in v.cache.layers)
    for a, b in zip(stock, fast):
        assert torch.equal(a, b)


def test_the_gqa_function_is_only_taken_inside_a_tree_pass_of_this_thread(monkeypatch):
    model = get("llama")
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        calls.append((threading.get_ident(), bool(k.get("enable_gqa"))))
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)  # outside a tree pass: transformers' own path
        assert calls and not any(g for _, g in calls)
        calls.clear()
        seen = {}

        def other():
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask)
            seen["gqa"] = any(g for t, g in calls if t == threading.get_ident())

        with attention.tree_pass():
            model(input_ids=ids, attention_mask=mask)
            th = threading.Thread(target=other)
            th.start()
            th.join()
    assert any(g for t, g in calls if t == threading.get_ident())
    assert seen["gqa"] is False


def test_headroom_layer_grows_crops_and_resets():
    layer = HeadroomLayer()
    k = torch.randn(1, 2, 3, 4)
    keys, values = layer.update(k, k + 1)
    assert torch.equal(keys, k) and layer.get_seq_length() == 3
    first = layer._kbuf
    assert first.shape[-2] == 3 + 256  # room for 256 more positions (or a quarter more, if larger)
    big = torch.randn(1, 2, 300, 4)
    keys, _ = layer.update(big, big)  # past the first buffer: reallocated, contents kept
    assert layer._kbuf is not first and layer._kbuf.shape[-2] == 303 + 256
    assert torch.equal(keys, torch.cat([k, big], dim=-2)) and layer.get_seq_length() == 303
    layer.crop(-5)
    assert layer.get_seq_length() == 298 and torch.equal(layer.keys, torch.cat([k, big], dim=-2)[:, :, :298])
    keys, _ = layer.update(k, k)
    assert torch.equal(keys[:, :, 298:], k)
    long = HeadroomLayer()
    long.update(torch.randn(1, 2, 4000, 4), torch.randn(1, 2, 4000, 4))
    assert long._kbuf.shape[-2] == 5000  # a long prompt's cache: a quarter more, not twice
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)
    layer.reset()
    assert layer.get_seq_length() == 0


def _f32(arch):
    m = tiny(arch)
    return m.to(torch.float32)


@pytest.mark.skipif(not skinny.packed_available([torch.nn.Linear(4, 4)]), reason="no MKL packed GEMM in this torch")
@pytest.mark.parametrize("arch,policy", [("llama", "spine"), ("qwen2", "spine")])
def test_packed_tree_passes_are_lossless(arch, policy):
    model = _f32(arch)
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 60, 2, 5, 17]
    want = hf_greedy(model, prompt, 20)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy=policy, budget=24,
                        verifier_options={"linear": "packed"})
    out = dec.generate(prompt, max_new_tokens=20)
    assert out.token_ids == want
    vstats = out.stats.extra["verifier"]
    trees = sum(v for k, v in out.stats.routes.items() if k != "single")
    assert trees > 0 and vstats.get("packed_passes", 0) == trees
    assert all("forward" not in m.__dict__ for m in skinny.linears(model))  # the reroute is temporary


@pytest.mark.skipif(not skinny.packed_available([torch.nn.Linear(4, 4)]), reason="no MKL packed GEMM in this torch")
def test_packed_form_computes_the_same_product_and_repacks_a_changed_weight():
    lin = torch.nn.Linear(24, 40)
    x = torch.randn(1, 7, 24)
    with torch.inference_mode(), skinny.rerouted(lin, [lin], "packed"):
        y = lin(x)
        one = lin(x[:, :1])  # one row: exactly F.linear
    assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(one, torch.nn.functional.linear(x[:, :1], lin.weight, lin.bias))
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the version counter moves, the pack is made again
    with torch.inference_mode(), skinny.rerouted(lin, [lin], "packed"):
        y2 = lin(x)
    assert torch.allclose(y2, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    skinny.release_packs([lin])
    assert lin not in skinny._packs


@pytest.mark.skipif(not skinny.packed_available([torch.nn.Linear(4, 4)]), reason="no MKL packed GEMM in this torch")
def test_the_packs_memory_is_measured_reported_and_bounded():
    model = _f32("llama")
    mods = skinny.linears(model)
    skinny.release_packs(mods)
    weights = sum(m.weight.nbytes for m in mods)
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 60, 2, 5, 17]
    want = hf_greedy(model, prompt, 16)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=24, verifier_options={"linear": "packed"})
    out = dec.generate(prompt, max_new_tokens=16)
    lin = out.stats.extra["verifier"]["linear"]
    assert out.token_ids == want and lin["packed"] is True and lin["option"] == "packed"
    made = skinny.packed_bytes(mods)
    assert made > 0 and lin["packed_mib"] == round(made / 2**20, 1)
    assert skinny.pack_estimate(mods) == made  # once made, the estimate is what they measured
    # a limit below what the packs take: linear='packed' is refused at compose, naming the option
    skinny.release_packs(mods)
    with pytest.raises(UnsupportedModelError, match=r"linear='packed' needs about .* MiB for the packs, within pack_limit_mib \(0 MiB\).*raise pack_limit_mib"):
        goose.compose(model, None, sources=["pld"], policy="chain", verifier_options={"linear": "packed", "pack_limit_mib": 0})
    # 0: never pack; the output is the same, nothing is packed, the curve is another one (no packed form)
    dec0 = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=24, verifier_options={"pack_limit_mib": 0})
    out0 = dec0.generate(prompt, max_new_tokens=16)
    assert out0.token_ids == want
    assert out0.stats.extra["verifier"]["linear"]["packed"] is False and out0.stats.extra["verifier"]["linear"]["packed_mib"] == 0.0
    assert skinny.packed_bytes(mods) == 0 and dec0.verifier.timing_key()["packed"] is False
    assert "packed" not in dec.verifier.timing_key()
    assert weights < 2**20 and skinny.prepack(mods, limit_mib=4) and skinny.packed_bytes(mods) > 0
    skinny.release_packs(mods)
    # packs that measure over the limit once made are dropped again (16 MiB of weights, a 4 MiB limit)
    big = [torch.nn.Linear(2048, 2048, bias=False)]
    assert skinny.prepack(big, limit_mib=4) is False and big[0] not in skinny._packs
    assert skinny.prepack(big, limit_mib=1024) is True and skinny.packed_bytes(big) >= big[0].weight.nbytes // 2
    skinny.release_packs(big)


def test_packed_is_refused_where_it_cannot_serve():
    model = get("llama")  # float64: MKL's packed GEMM is float32 only
    with pytest.raises(UnsupportedModelError, match="linear='packed'.*float32.*Hint: leave linear='auto'"):
        goose.compose(model, None, sources=["pld"], policy="chain", verifier_options={"linear": "packed"})
    with pytest.raises(ValueError, match="not one of"):
        with skinny.rerouted(model, None, "fast"):
            pass


def test_kernel_options_refuse_bad_values_with_what_is_allowed():
    from goose.errors import InvalidInputError

    model = get("llama")
    with pytest.raises(InvalidInputError, match=r"gqa: .*True or False is required, got 'maybe'.*Allowed options: defer_prefill_rows, gqa, headroom, linear, pack_limit_mib"):
        goose.compose(model, None, sources=["pld"], policy="chain", verifier_options={"gqa": "maybe"})
    with pytest.raises(InvalidInputError, match=r"linear: Input should be 'auto', 'stock', 'skinny', 'packed' or 'stream' \(got 'fast'\)"):
        goose.compose(model, None, sources=["pld"], policy="chain", verifier_options={"linear": "fast"})
