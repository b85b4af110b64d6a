"""Goose is a guest in its caller's process: what a call leaves behind, and what other threads see meanwhile.

- The caller's torch thread count (and numba's, for the calling thread) is what it was before the call,
  however many stream passes ran, the first one (which launches numba's thread pool) included.
- transformers' attention mapping holds its own ``sdpa`` entry again once Goose's passes end, and every
  linear layer runs its class's ``forward``; a plain forward after Goose ran equals one before, to the bit.
- Another thread running ``model.generate`` on the same model, or on another one, while Goose decodes
  (tree passes through Goose's attention function and the stream kernel) gets exactly the tokens and
  logits it gets alone.
"""

import copy
import os
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

import goose
from goose.verifiers import stream

from test_hf_architectures import V, get

needs_numba = pytest.mark.skipif(stream._kernel() is None, reason="numba is not installed")


def _f32(arch):
    return copy.deepcopy(get(arch)).float()


_THREADS_PROBE = """
import sys
sys.path.insert(0, {tests!r})
import torch
import goose
from test_hf_architectures import get
model = get("llama").float()
dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16,
                    verifier_options={{"linear": "stream"}})

def run():
    out = dec.generate(torch.tensor([3, 5, 7, 3, 5, 7, 3, 5]), max_new_tokens=12)
    assert out.stats.extra["verifier"]["stream_passes"] > 0, out.stats.extra

torch.set_num_threads(1)
run()  # the first stream pass of the process: numba launches its thread pool
import numba
first = torch.get_num_threads()
torch.set_num_threads(2)
numba.set_num_threads(1)  # the caller's own numba setting, in this thread
run()  # the kernel runs on torch's two threads
print(first, torch.get_num_threads(), numba.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
"""


@needs_numba
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: numba's pool would set one thread too")
def test_the_callers_thread_counts_are_left_as_they_were():
    """In a fresh process (numba launches its pool once per process): torch pinned to one thread, a decoder
    whose every pass after the prompt runs the stream kernel; torch still has one after. Then torch on two
    threads and numba on one in the calling thread: numba still has one after."""
    tests = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as cwd:  # outside the clone: the installed goose, not ./goose
        run = subprocess.run([sys.executable, "-c", _THREADS_PROBE.format(tests=tests)], capture_output=True,
                             text=True, timeout=600, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    first, torch_n, numba_n, pool = map(int, run.stdout.split()[-4:])
    assert pool >= 2  # the pool numba launched would have set two or more
    assert (first, torch_n, numba_n) == (1, 2, 1)


def _plain(model, prompt, n):
    """transformers' greedy: the tokens and every step's logits."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)


def _forward(model, prompt):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt])).logits


def _state(model):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"], [m for m in model.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("linear", ["stream", "skinny"] if stream._kernel() is not None else ["skinny"])
def test_other_threads_get_what_they_get_alone_and_nothing_stays_changed(linear):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, other = _f32("llama"), _f32("qwen2")
    assert model.model.layers[0].self_attn.num_key_value_groups > 1  # Goose's tree passes read heads in place
    prompt = [(7 * i + 3) % V for i in range(12)] * 2
    sdpa_before, swapped_before = _state(model)
    assert sdpa_before is sdpa_attention_forward and not swapped_before
    before = _forward(model, prompt)
    alone = {"same": _plain(model, prompt, 16), "other": _plain(other, prompt, 16)}

    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16,
                        verifier_options={"linear": linear})
    stop, errors, plain_runs, goose_runs = threading.Event(), [], [0], [0]
    seen = {"sdpa": set()}

    def decode():
        try:
            while not stop.is_set():
                out = dec.generate(torch.tensor(prompt), max_new_tokens=24)
                assert out.stats.extra["verifier"][f"{linear}_passes"] > 0  # passes ran in the form asked for
                assert max(out.stats.accept_lengths) > 0  # trees were verified (masked passes)
                goose_runs[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    me = threading.get_ident()

    def look(_module, _args, _out):  # which sdpa entry this thread's attention layers found
        if threading.get_ident() == me:
            seen["sdpa"].add(ALL_ATTENTION_FUNCTIONS["sdpa"])

    hooks = [m.self_attn.register_forward_hook(look) for m in (*model.model.layers, *other.model.layers)]

    def plain():
        try:
            for k in range(8):
                which = "same" if k % 2 == 0 else "other"
                tokens, logits = _plain(model if which == "same" else other, prompt, 16)
                assert tokens == alone[which][0], (which, k)
                assert torch.equal(logits, alone[which][1]), (which, k)
                plain_runs[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the threads interleave inside every forward
    try:
        g = threading.Thread(target=decode)
        g.start()
        plain()
        stop.set()
        g.join()
    finally:
        sys.setswitchinterval(switch)
        for h in hooks:
            h.remove()
    assert not errors, errors[0]
    assert plain_runs[0] == 8 and goose_runs[0] >= 1
    assert len(seen["sdpa"]) == 2  # the plain calls did run while Goose's function stood in for sdpa

    sdpa_after, swapped_after = _state(model)
    assert sdpa_after is sdpa_attention_forward and not swapped_after
    assert torch.equal(_forward(model, prompt), before)


def test_attention_registration_after_goose_ran_still_takes_effect():
    """Putting transformers' entry back must not pin it in the mapping's instance entries, where it would
    hide a later ``AttentionInterface.register("sdpa", ...)`` from every model."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    model = _f32("llama")
    dec = goose.compose(model, None, sources=["pld"], policy="chain", budget=8, verifier_options={"linear": "stock"})
    dec.generate(torch.tensor([5, 6, 7, 5, 6, 7, 5, 6]), max_new_tokens=8)
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa", spy)
    try:
        _forward(model, [1, 2, 3])
        assert calls and ALL_ATTENTION_FUNCTIONS["sdpa"] is spy
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
