"""The stream kernel (verifiers/stream.py): the product, row invariance, refusals, and lossless decoding with it forced on.

With the kernel, Goose's reference is greedy decoding under the same kernel: the prompt's prefill
with stock linear layers, every later token's forward through the kernel (:func:`stream_greedy`).
Because every row of every pass is summed in one order, whatever shares the pass, a decoder's
output must equal that reference token for token whatever it drafts; against transformers' own
greedy (stock GEMV) it may differ only at a near-tie, which the real-model test measures.
"""

import copy
import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.errors import UnsupportedModelError
from goose.testing.kit import ReferenceTreeSource
from goose.verifiers import skinny, stream

from test_hf_architectures import V, get
from test_prefill_rows import cached

pytestmark = pytest.mark.skipif(stream._kernel() is None, reason="numba is not installed")

# (out features, in features) of the three models' linear layers; the LM heads cut to a slice whose
# row count is not a multiple of the kernel's block (the tail path), full heads in the real-model test
SHAPES = {
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536), (4099, 576)],
    "gemma-3-270m": [(1024, 640), (256, 640), (2048, 640), (640, 2048), (4101, 640)],
    "qwen2.5-coder-1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (2053, 1536)],
}
ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 64)


def _close_to_float64(got, x, w, b=None):
    """The kernel's float32 result is as close to the float64 product as F.linear's is (within 2x, plus
    a few float32 ulps of the result's scale)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (got.double() - exact).abs().max().item()
    ref_err = (F.linear(x, w, b).double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert err <= 2 * ref_err + 8 * torch.finfo(torch.float32).eps * scale, (err, ref_err, scale)


@pytest.mark.parametrize("model", list(SHAPES))
def test_kernel_equals_linear_on_the_models_shapes(model):
    g = torch.Generator().manual_seed(1)
    for out_f, in_f in SHAPES[model]:
        w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
        b = torch.randn(out_f, generator=g)
        for rows in ROWS:
            x = torch.randn(rows, in_f, generator=g)
            got = stream.linear(x, w)
            assert got.shape == (rows, out_f) and got.dtype == torch.float32
            _close_to_float64(got, x, w)
        _close_to_float64(stream.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("k_dim", [8, 24, 100, 577])
def test_kernel_equals_linear_at_inner_dimensions_past_the_vectors(k_dim):
    """The last k % 16 columns (all of them below 16) count: the model shapes above are multiples of 16."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(41, k_dim, generator=g)  # blocks of six and twelve, and a tail of five rows
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, k_dim, generator=g)
        _close_to_float64(stream.linear(x, w), x, w)


@pytest.mark.parametrize("k_dim", [96, 100])
def test_rows_are_invariant_to_what_shares_the_pass(k_dim):
    """A row's result, bit for bit: alone, in any order among others, beside different rows, at any
    row count and with one thread or two (an inner dimension of 100: the last 100 % 16 columns, past
    the 16-lane vectors, included)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1037, k_dim, generator=g)  # 1037: blocks of six and of twelve, and a tail of five rows
    x = torch.randn(64, k_dim, generator=g)
    full = stream.linear(x, w)
    for rows in ROWS:
        part = stream.linear(x[:rows], w)
        assert torch.equal(part, full[:rows]), rows
    alone = torch.cat([stream.linear(x[i : i + 1], w) for i in range(64)])
    assert torch.equal(alone, full)
    perm = torch.randperm(64, generator=g)
    assert torch.equal(stream.linear(x[perm], w)[perm.argsort()], full)
    other = torch.randn(7, k_dim, generator=g)
    assert torch.equal(stream.linear(torch.cat([other, x[:9]]), w)[7:], full[:9])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(stream.linear(x, w), full)
    finally:
        torch.set_num_threads(threads)


def test_inputs_that_are_not_contiguous_and_mismatched_widths():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(24, 6, generator=g).t()  # 6 rows, not contiguous
    assert torch.equal(stream.linear(x, w), stream.linear(x.contiguous(), w))
    with pytest.raises(ValueError, match="input has 6 features; the weight takes 24"):
        stream.linear(torch.randn(3, 6), w)


def test_a_rerouted_layer_runs_the_kernel_for_one_row_and_many():
    lin = torch.nn.Linear(24, 40)
    x = torch.randn(1, 7, 24)
    with skinny.rerouted(lin, [lin], "stream"):
        many, one = lin(x), lin(x[:, :1])
    assert torch.equal(many, stream.linear(x[0], lin.weight, lin.bias).view(1, 7, 40))
    assert torch.equal(one, stream.linear(x[0, :1], lin.weight, lin.bias).view(1, 1, 40))
    assert "forward" not in lin.__dict__
    # the other forms leave one row to F.linear
    with skinny.rerouted(lin, [lin], "skinny"):
        assert torch.equal(lin(x[:, :1]), F.linear(x[:, :1], lin.weight, lin.bias))


def _f32(arch):
    return copy.deepcopy(get(arch)).float()


_STREAM_MODELS: dict = {}


def _model(arch):
    """A float32 copy of the tiny stock model, made once per architecture."""
    if arch not in _STREAM_MODELS:
        _STREAM_MODELS[arch] = _f32(arch)
    return _STREAM_MODELS[arch]


def test_bfloat16_weights_are_refused_with_what_is_allowed():
    model = copy.deepcopy(get("llama")).to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match=r"linear='stream' serves float32 weights on the CPU; this "
                                                    r"model's are torch.bfloat16 on cpu\. Allowed here: 'auto'"):
        goose.compose(model, None, sources=["pld"], policy="chain", verifier_options={"linear": "stream"})
    assert not stream.available(skinny.linears(model))
    # auto keeps serving it (stock linears): the kernel is no form its passes may run in
    dec = goose.compose(model, None, sources=["pld"], policy="chain")
    assert "stream" not in dec.verifier.pass_forms() and dec.verifier.timing_key()["stream"] is False
    out = dec.generate([5, 17, 33, 5, 17, 33, 5, 17], max_new_tokens=6)
    assert len(out.token_ids) == 6 and "stream_passes" not in out.stats.extra["verifier"]


def test_a_model_without_plain_linear_layers_is_refused():
    from goose.testing import ToyCausalLM

    with pytest.raises(UnsupportedModelError, match=r"linear='stream' found no plain torch.nn.Linear layers in this "
                                                    r"model to serve\. Allowed: 'auto', 'stock'\. Hint"):
        goose.compose(ToyCausalLM(16), None, sources=["pld"], policy="chain", verifier_options={"linear": "stream"})


class _Timed(goose.Verifier):
    """A verifier whose speed protocol reports ``times(n, form)`` seconds for a pass of n nodes (form None: its
    default), with the built-in's forms and the rows each serves; ``timed`` records every (n, form) timed."""

    name = "timed"

    def __init__(self, times):
        super().__init__()
        self.times, self.timed = times, []
        self.vocab_size = V

    def prefill(self, prompt_ids, keep=None, rule=None):
        return None  # only its passes' times are asked for

    def verify(self, tree, rule=None):
        raise AssertionError("the calibration times passes through time_pass")

    def pass_forms(self):
        return ("skinny", "stream")

    def form_serves(self, form, rows):
        return skinny.serves(form, rows)

    def time_pass(self, tree, form=None):
        self.timed.append((tree.num_nodes, form))
        return self.times(tree.num_nodes, form)


def _calibrate(times):
    """The calibration over sizes 1-4 of a verifier whose passes take ``times(n, form)``: (curve, what its walk over
    the sizes timed, after the warm-up at one row and at the middle size, 4, in every form)."""
    from goose.verifiers.latency import measure

    v = _Timed(times)
    curve = measure(None, v, sizes=(1, 2, 3, 4), repeats=1, measure_head=False)
    t = v.timed
    assert all(skinny.serves(f, n) for n, f in t if f is not None)  # a form only at the rows it serves
    assert t[:3] == [(1, None)] * 3 and {(4, "skinny"), (4, "stream")} <= set(t)  # the warm-up
    walk = next(i for i in range(3, len(t)) if t[i] == (1, None))
    return curve, t[walk:]


def test_calibration_compares_one_row_and_drops_forms_far_slower():
    # stream fastest everywhere; stock and skinny over 1.5x it at the warm-up's size: neither compared after
    curve, walk = _calibrate(lambda n, f: {None: 1.0 + 0.1 * n, "stream": 0.6 + 0.05 * n, "skinny": 0.9 + 0.1 * n}[f])
    assert curve.forms == (("stream", (1, 2, 3, 4)),)
    assert {f for n, f in walk if n > 1} == {"stream"}  # neither stock nor skinny timed at 2-4 rows after the warm-up
    assert (1, "stream") in walk and curve(1) == pytest.approx(0.65)  # trees are priced in units of the one-token
    # step as it will run
    # stock's one-row GEMV is timed at one row even when stock was dropped: there it can still win
    curve, walk = _calibrate(lambda n, f: {None: 0.5 if n == 1 else 3.0, "stream": 0.6 + 0.05 * n, "skinny": 9.0}[f])
    assert walk.count((1, None)) > 3 and {f for n, f in walk if n > 1} == {"stream"}
    assert curve.form(1) is None and curve.form(2) == "stream" and curve(1) == pytest.approx(0.5)


def test_missing_numba_is_refused_with_a_hint(monkeypatch):
    monkeypatch.setattr(stream, "_kernel", lambda: None)
    with pytest.raises(UnsupportedModelError, match=r"linear='stream' needs numba.*Hint: pip install numba"):
        goose.compose(_f32("llama"), None, sources=["pld"], policy="chain", verifier_options={"linear": "stream"})


_WIDTH_PROBE = """
import json, re, sys
import numpy as np
import numba
from goose.verifiers import stream
stream._kernel()  # decides the width (numba has compiled nothing before it), then compiles
fresh = numba.njit(parallel=True, fastmath=True, cache=False, boundscheck=False)(stream._xwt)  # inspectable
x, w, o = np.ones((2, 576), np.float32), np.ones((24, 576), np.float32), np.zeros((2, 24), np.float32)
fresh(x, w, o)
asm = "\\n".join(fresh.inspect_asm().values())
fma = {r: len(re.findall(r"vfmadd\\w+[^\\n]*%s" % r, asm)) for r in ("zmm", "ymm")}
print(json.dumps({"width": stream.vector_width(), "fma": fma, "ok": bool((o == 576).all())}))
"""


def _run_probe(code, **env):
    import subprocess
    import tempfile

    # run outside the clone: with `python -c` the working folder comes first on sys.path, and the
    # clone's goose/ (which has no verifiers/ inside) would shadow the installed package
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env}, cwd=cwd)


def _width_probe(**env):
    import json

    run = _run_probe(_WIDTH_PROBE, **env)
    assert run.returncode == 0, f"the width probe under {env} exited {run.returncode}:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


_KERNEL_PROBE = """
import json
import torch
from goose.verifiers import stream
g = torch.Generator().manual_seed(5)
x, w = torch.randn(7, 100, generator=g), torch.randn(45, 100, generator=g)
err = (stream.linear(x, w).double() - x.double() @ w.double().T).abs().max().item()
print(json.dumps({"info": stream.kernel_info(), "err": err}))
"""


def test_the_kernel_choice_and_a_bad_one():
    import json

    avx512 = stream._avx512()
    assert stream.kernel_info()["kernel"] == ("blocks" if avx512 else "loop")
    assert stream.row_multiple() == (4 if avx512 else 2)
    # the block kernel runs one row as it is, up to six padded to even (jobs of one and two rows), more to four
    assert [stream.padded_rows(n) for n in (1, 2, 3, 5, 8)] == ([1, 2, 4, 6, 8] if avx512 else [2, 2, 4, 6, 8])
    loop = _run_probe(_KERNEL_PROBE, GOOSE_STREAM_KERNEL="loop")
    assert loop.returncode == 0, loop.stderr[-3000:]
    got = json.loads(loop.stdout.strip().splitlines()[-1])
    assert got["info"] == {"kernel": "loop", "rows": 2, "why": "$GOOSE_STREAM_KERNEL=loop"} and got["err"] < 1e-4, got
    bad = _run_probe(_KERNEL_PROBE, GOOSE_STREAM_KERNEL="fast")
    assert bad.returncode != 0
    assert "$GOOSE_STREAM_KERNEL='fast' is not a stream kernel. Allowed: 'auto'" in bad.stderr, bad.stderr[-3000:]
    assert "Hint: unset it" in bad.stderr
    if not avx512:
        blocks = _run_probe(_KERNEL_PROBE, GOOSE_STREAM_KERNEL="blocks")
        assert blocks.returncode != 0 and "'blocks' needs AVX-512" in blocks.stderr, blocks.stderr[-3000:]


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else True,
                    reason="needs a CPU with AVX-512")
def test_the_kernel_multiplies_in_512_bit_vectors_where_llvm_would_prefer_256():
    # LLVM's tuning for Sapphire Rapids (the AMX Xeons') prefers 256-bit vectors: compiled for that CPU
    # with numba's own choice, the kernel's multiply-adds are ymm; with the width Goose asks for, zmm
    spr = {"NUMBA_CPU_NAME": "sapphirerapids"}
    wide = _width_probe(**spr)
    assert wide["ok"] and wide["width"]["bits"] == 512
    assert wide["fma"]["zmm"] >= 24 and wide["fma"]["ymm"] < wide["fma"]["zmm"] / 4, wide  # the main loop: 24 sums
    default = _width_probe(**spr, GOOSE_STREAM_WIDE="0")
    assert default["ok"] and default["width"]["bits"] is None and "GOOSE_STREAM_WIDE=0" in default["width"]["why"]
    assert default["fma"]["zmm"] == 0 and default["fma"]["ymm"] >= 24, default
    # a width numba was told: Goose leaves it
    told = _width_probe(**spr, NUMBA_CPU_FEATURES="+avx2,+fma,+avx512f")
    assert told["width"]["bits"] is None and "NUMBA_CPU_FEATURES" in told["width"]["why"]


def stream_greedy(model, prompt, n):
    """Greedy decoding under the kernel, written plainly: the prompt in one stock forward, then one
    token per forward with every linear layer through the kernel."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt])
    out = []
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1]
        for _ in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            with skinny.rerouted(model, skinny.linears(model), "stream"):
                logits = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{kw: cache}).logits[0, -1]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@settings(max_examples=10, deadline=None)
@given(
    prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=20),
    n=st.integers(1, 30),
    budget=st.integers(2, 20),
    seed=st.integers(0, 2**31),
    p=st.sampled_from([0.5, 0.9]),
)
def test_arbitrary_trees_equal_greedy_under_the_kernel(arch, prompt, n, budget, seed, p):
    model = _model(arch)
    ref = stream_greedy(model, prompt, n)
    src = ReferenceTreeSource(prompt + ref, seed, p, V, p_chain=0.4)
    dec = goose.compose(model, None, sources=[src], policy="proposal", budget=budget,
                        verifier_options={"linear": "stream"})
    out = dec.generate(prompt, max_new_tokens=n)
    assert out.token_ids == ref
    passes = out.stats.extra["verifier"].get("stream_passes", 0)
    assert passes == out.stats.steps  # every pass after the prefill, one-token steps included, ran the kernel


def _property_fails() -> bool:
    try:
        for arch in ("llama", "qwen2"):
            test_arbitrary_trees_equal_greedy_under_the_kernel(arch)
    except AssertionError:
        return True
    return False


def test_fault_rows_out_of_order_is_caught(monkeypatch):
    """The kernel's rows handed back one place out of order in passes of two or more rows: the
    property above must fail."""
    real = stream.linear

    def shifted(x, weight, bias=None):
        out = real(x, weight, bias)
        return out.roll(1, dims=0) if x.shape[0] > 1 else out

    monkeypatch.setattr(stream, "linear", shifted)
    assert _property_fails()


class _Cycle(goose.DraftSource):
    """A chain of 0-3 tokens by the context's length (right or not): passes of 1 to 4 nodes."""

    name = "cycle"

    def propose(self, state):
        k, t = len(state.tokens) % 4, state.tokens[-1]
        return goose.Proposal.chain(self.name, [(t + i) % V for i in range(1, k + 1)]) if k else None


def _sizes_and_stats(dec, prompt, n):
    """Generate; (the size of every pass after the prefill, the verifier's stats)."""
    sizes = []

    class Sizes:
        @goose.hookimpl
        def goose_on_step(self, decoder, step):
            if decoder is dec:
                sizes.append(step.tree.num_nodes)

    goose.register_plugin(Sizes(), name="stream-sizes-seen")
    try:
        out = dec.generate(prompt, max_new_tokens=n)
    finally:
        goose.unregister_plugin("stream-sizes-seen")
    assert len(out.token_ids) == n
    return sizes, out.stats.extra["verifier"]


def test_auto_runs_the_calibrated_sizes_one_row_included():
    from goose.verifiers import latency

    model = _model("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 60, 2, 5, 17]
    curve = latency.LatencyCurve((1, 2, 4), (1.0, 1.0, 1.0), forms=(("skinny", (2,)), ("stream", (1, 4))))
    dec = goose.compose(model, None, sources=[_Cycle()], policy="chain", budget=8)
    with cached(model, dec.verifier, curve):
        sizes, vstats = _sizes_and_stats(dec, prompt, 24)
    assert set(sizes) == {1, 2, 3, 4}
    lin = vstats["linear"]
    assert lin["forms"] == {"1": "stream", "2": "skinny", "4": "stream"}  # size 3: stock
    assert vstats.get("stream_passes", 0) == sizes.count(1) + sizes.count(4) and sizes.count(1) > 0
    assert vstats.get("skinny_passes", 0) == sizes.count(2)
    assert lin["stream"] and lin["stream_extra_mib"] == 0.0
    assert lin["stream_vector_bits"] == stream.vector_width()["bits"]
    forced = goose.compose(model, None, sources=[_Cycle()], policy="chain", budget=8,
                           verifier_options={"linear": "skinny"})
    sizes, vstats = _sizes_and_stats(forced, prompt, 24)
    # every pass of 2 or more nodes in the forced form, one-token steps stock
    assert vstats.get("skinny_passes", 0) == sum(1 for n in sizes if n > 1) > 0 and "stream_passes" not in vstats


REQUIRE = os.environ.get("GOOSE_REQUIRE_MODELS", "") == "1"


def _real_weights_through_the_kernel(model, rows: tuple[int, ...]) -> set:
    """Every distinct weight shape of the model's linear layers through the kernel at these row counts,
    against the float64 product; the shapes seen."""
    g = torch.Generator().manual_seed(4)
    seen = set()
    for m in skinny.linears(model):
        if m.weight.shape in seen:
            continue
        seen.add(m.weight.shape)
        for n in rows:
            x = torch.randn(n, m.weight.shape[1], generator=g)
            _close_to_float64(stream.linear(x, m.weight, m.bias), x, m.weight, m.bias)
    return seen


@pytest.mark.real_model
def test_smollm2_with_the_kernel_forced(monkeypatch):
    """SmolLM2 float32: the kernel on its real weights (every layer, the whole LM head), and decoders with
    the kernel forced on equal greedy under the kernel on real prompts; where that greedy differs from
    transformers' own, the two logits were within a near-tie."""
    from goose.tools import datasets, models
    from goose.tools.bench import top2_gap

    if not models.installed()["smollm2"]:
        if REQUIRE:
            pytest.fail("SmolLM2 not pulled: run `goose models pull smollm2`")
        pytest.skip("SmolLM2 not pulled")
    model, tok = models.load("smollm2", "float32")
    assert (49152, 576) in _real_weights_through_the_kernel(model, (1, 5, 32))  # the tied LM head
    prompts = [p for p in datasets.demo()][:2]
    for p in prompts:
        ids = tok(p.text, return_tensors="pt")["input_ids"][0].tolist()
        ref = stream_greedy(model, ids, 32)
        with torch.inference_mode():
            hf = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        if hf != ref:
            pos = next(i for i, (a, b) in enumerate(zip(hf, ref)) if a != b)
            assert top2_gap(model, torch.tensor([ids]), hf, pos) < 1e-2, (p.id, pos)
        for policy in ("none", "spine", "spine-fit"):
            dec = goose.compose(model, tok, sources=[] if policy == "none" else ["pld", "tr"], policy=policy,
                                verifier_options={"linear": "stream"})
            out = dec.generate(ids, max_new_tokens=32)
            assert out.token_ids == ref, (p.id, policy)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("policy", ["spine", "iso3"])
def test_one_decoder_in_four_threads_with_the_kernel(policy, sample):
    """The kernel entered by four threads at once (numba's parallel region from each): every call equals
    the same call made alone (tests/test_threads.py's calls and runner)."""
    from test_threads import _generate, run_threads

    model = _model("llama")
    calls = [[dict(prompt=[(3 * t + 5 * j + i) % V for i in range(14)] * 2, n=12 + 5 * t, seed=100 * t + j if sample else None)
              for j in range(2)] for t in range(4)]

    def compose():
        return goose.compose(model, None, sources=["pld", "tr"], policy=policy, budget=24,
                             verifier_options={"linear": "stream"})

    alone = compose()
    expected = {(t, j): _generate(alone, c, sample) for t, cs in enumerate(calls) for j, c in enumerate(cs)}
    if not sample:
        assert expected[0, 0] == stream_greedy(model, calls[0][0]["prompt"], calls[0][0]["n"])
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # threads interleave inside every forward
    try:
        got, errors = run_threads(compose(), calls, sample)
    finally:
        sys.setswitchinterval(before)
    assert not errors, errors[0]
    assert got == expected


@pytest.mark.real_model
def test_gemma3_real_weights():
    """Gemma-3-270M's real weights, every distinct shape (its 262,144-row LM head included), 1-32 rows."""
    from goose.tools import models

    if not models.installed()["gemma-3-270m"]:
        if REQUIRE:
            pytest.fail("Gemma-3-270M not pulled: run `goose models pull gemma-3-270m`")
        pytest.skip("Gemma-3-270M not pulled")
    model, _ = models.load("gemma-3-270m", "float32")
    assert (262144, 640) in _real_weights_through_the_kernel(model, (1, 3, 32))
