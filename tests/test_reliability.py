"""Reliability: one decoder in several threads, failures mid-generation, long prompts (issue 13)."""

import threading

import pytest
import torch

import goose
from goose.testing import ToyCausalLM, reference_greedy

CONFIGS = [
    dict(sources=["pld", "tr"], policy="spine"),
    dict(sources=["pld", "tr"], policy="spine-fit", policy_options={"latency": {1: 1.0, 128: 1.0}}),
    dict(sources=["pld"], policy="chain"),
]


def _prompts(k):
    return [[(3 * i + j * (i % 5 + 1)) % 16 for j in range(6 + i % 7)] for i in range(k)]


# -- several threads, one decoder ---------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=["spine", "spine-fit", "pld-chain"])
def test_threads_share_one_decoder_and_every_output_is_greedy(cfg):
    dec = goose.compose(ToyCausalLM(16), None, budget=24, **cfg)
    prompts = _prompts(24)
    results, errors = {}, []
    start = threading.Barrier(4)

    def work(t):
        try:
            start.wait()
            for i in range(t, len(prompts), 4):
                for n in (17, 40):
                    results[i, n] = dec.generate(prompts[i], max_new_tokens=n).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for (i, n), toks in results.items():
        assert toks == reference_greedy(prompts[i], n, 16), (i, n)
    assert len(results) == 48
    assert dec._workers >= 1 and len(dec._idle) == dec._workers  # every set went back to the pool


class _Gate:
    """Observer that holds the first generation inside its first step until released."""

    def __init__(self):
        self.inside, self.release, self.first = threading.Event(), threading.Event(), True

    @goose.hookimpl
    def goose_on_step(self, decoder, step):
        if self.first:
            self.first = False
            self.inside.set()
            assert self.release.wait(10)


def _run_overlapping(dec, prompt, n):
    """Run one generation that is held mid-step, and a second one while the first is held."""
    gate = _Gate()
    goose.register_plugin(gate, name="gate")
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("a", dec.generate(prompt, max_new_tokens=n)))
    th.start()
    try:
        assert gate.inside.wait(10)
        try:
            out["b"] = dec.generate(prompt, max_new_tokens=n)
        except goose.DecoderBusyError as exc:
            out["b"] = exc
    finally:
        gate.release.set()
        th.join()
        goose.unregister_plugin("gate")
    return out


def test_a_second_call_mid_generation_gets_its_own_components():
    dec = goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine", budget=24)
    prompt = [1, 2, 3, 1, 2, 3, 4]
    out = _run_overlapping(dec, prompt, 30)
    assert out["a"].token_ids == out["b"].token_ids == reference_greedy(prompt, 30, 16)
    assert dec._workers == 2


class _Locked(goose.DraftSource):
    """A plugin source holding something that cannot be copied (a lock)."""

    name = "locked"

    def __init__(self, options=None):
        super().__init__(options)
        self.lock = threading.Lock()

    def propose(self, state):
        return goose.Proposal.chain(self.name, [state.anchor])


def test_components_that_cannot_be_copied_refuse_a_concurrent_call():
    dec = goose.compose(ToyCausalLM(16), None, sources=[_Locked()], policy="chain", budget=8)
    prompt = [5, 6, 7]
    out = _run_overlapping(dec, prompt, 12)
    assert isinstance(out["b"], goose.DecoderBusyError)
    msg = str(out["b"])
    assert "generating in another thread" in msg and "compose one decoder per thread" in msg
    assert "cannot pickle" in msg or "lock" in msg  # names what could not be copied
    assert out["a"].token_ids == reference_greedy(prompt, 12, 16)
    assert dec.generate(prompt, max_new_tokens=12).token_ids == reference_greedy(prompt, 12, 16)


# -- failures mid-generation ---------------------------------------------------------------------
class _Boom(goose.DraftSource):
    """Proposes the anchor; raises ``exc`` on its ``at``-th propose call while armed."""

    name = "boom"
    armed, at, exc = True, 3, RuntimeError("source failed")

    def __init__(self, options=None):
        super().__init__(options)
        self.calls = 0

    def begin(self, request):
        self.calls = 0

    def propose(self, state):
        self.calls += 1
        if type(self).armed and self.calls == type(self).at:
            raise type(self).exc
        return goose.Proposal.chain(self.name, [state.anchor, state.anchor])


class _BadObserver:
    def __init__(self, exc):
        self.exc, self.armed, self.steps = exc, True, 0

    @goose.hookimpl
    def goose_on_step(self, decoder, step):
        self.steps += 1
        if self.armed and self.steps == 3:
            raise self.exc




@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "keyboard-interrupt"])
@pytest.mark.parametrize("where", ["source", "policy", "observer"])
def test_a_failure_mid_generation_leaves_the_decoder_usable_and_lossless(where, exc):
    prompt = [1, 2, 3, 4, 1, 2, 3]
    tr_opts = {"warm": True}
    if where == "source":
        _Boom.armed, _Boom.exc = True, exc
        dec = goose.compose(ToyCausalLM(16), None, sources=[_Boom(), ("tr", tr_opts)], policy="spine-fit",
                            policy_options={"latency": {1: 1.0, 128: 1.0}}, budget=24)
    else:
        dec = goose.compose(ToyCausalLM(16), None, sources=["pld", ("tr", tr_opts)], policy="spine-fit",
                            policy_options={"latency": {1: 1.0, 128: 1.0}}, budget=24)
    obs = None
    if where == "policy":
        real = dec.policy.shape
        calls = {"n": 0}

        def shape(ctx):
            calls["n"] += 1
            if calls["n"] == 3:
                raise exc
            return real(ctx)

        dec.policy.shape = shape
    if where == "observer":
        obs = _BadObserver(exc)
        goose.register_plugin(obs, name="bad-observer")
    try:
        expected = (goose.GooseError, type(exc)) if isinstance(exc, RuntimeError) else KeyboardInterrupt
        with pytest.raises(expected):
            dec.generate(prompt, max_new_tokens=40)
        # disarm and decode again with the same decoder: usable, lossless, the pool intact
        _Boom.armed = False
        if obs is not None:
            obs.armed = False
        for p, n in [(prompt, 40), ([9, 8, 7, 9, 8], 33)]:
            assert dec.generate(p, max_new_tokens=n).token_ids == reference_greedy(p, n, 16)
        assert len(dec._idle) == dec._workers
    finally:
        _Boom.armed = True
        if obs is not None:
            goose.unregister_plugin("bad-observer")


# -- long prompts ---------------------------------------------------------------------------------
def _tiny_llama(vocab=4096, positions=4096):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, eos_token_id=None, bos_token_id=None,
        pad_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(torch.float64).eval()


class _HeadRows:
    """Forward hook on the LM head: the most rows it ever produced logits for at once."""

    def __init__(self, model):
        self.rows = 0
        self.handle = model.get_output_embeddings().register_forward_hook(self)

    def __call__(self, module, args, output):
        self.rows = max(self.rows, output.shape[-2])


@pytest.mark.parametrize("window", [256, None])
def test_a_long_prompt_does_not_make_prompt_len_x_vocab_logits(window):
    """The prefill's logits are bounded: a 3,000-token prompt computes at most the TR window's rows
    (the reference harvest, ``prefill_window=None``, computes every position: the check can fail)."""
    model = _tiny_llama()
    prompt = torch.randint(0, 4096, (3000,), generator=torch.Generator().manual_seed(1))
    dec = goose.compose(model, None, sources=["pld", ("tr", {"prefill_window": window})], policy="spine", budget=24)
    rows = _HeadRows(model)
    try:
        out = dec.generate(prompt, max_new_tokens=8)
    finally:
        rows.handle.remove()
    with torch.inference_mode():
        ref = model.generate(prompt.view(1, -1), attention_mask=torch.ones(1, 3000, dtype=torch.long),
                             max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.token_ids == ref[0, 3000:].tolist()
    if window is None:
        assert rows.rows == 3000
    else:
        assert rows.rows <= 256
        assert out.stats.extra["verifier"]["prefill_logit_rows"] == 256


def test_the_logits_window_also_fits_a_memory_budget():
    """A large vocabulary gets fewer rows: prefill_max_mib bounds the matrix in bytes."""
    model = _tiny_llama(vocab=16384)
    prompt = torch.randint(0, 16384, (600,), generator=torch.Generator().manual_seed(2))
    dec = goose.compose(model, None, sources=[("tr", {"prefill_max_mib": 4.0})], policy="spine", budget=24)
    out = dec.generate(prompt, max_new_tokens=4)
    assert out.stats.extra["verifier"]["prefill_logit_rows"] == 4 * 2**20 // (4 * 16384)  # 64 rows


def test_plain_greedy_computes_only_the_last_row():
    model = _tiny_llama()
    prompt = torch.randint(0, 4096, (500,), generator=torch.Generator().manual_seed(3))
    rows = _HeadRows(model)
    try:
        goose.greedy(model).generate(prompt, max_new_tokens=3)
    finally:
        rows.handle.remove()
    assert rows.rows == 1
