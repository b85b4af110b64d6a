"""The prefill's deferred logit rows (verifier option ``defer_prefill_rows``).

The prefill computes the LM head for the last prompt position only; the rows the sources asked for
(token recycling's prompt harvest) are computed from the kept hidden states just before the first
draft, so a generation that ends at its first token never pays for them.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

import goose
from goose.verifiers.transformers_tree import TransformersVerifier, TreeVerifierOptions
from test_reliability import _tiny_llama


def _verifier(model, **opts):
    v = TransformersVerifier(TreeVerifierOptions(**opts))
    v.bind(model)
    return v


@contextlib.contextmanager
def cached(model, verifier, curve):
    """Within the block, ``curve`` is the latency curve cached for ``verifier`` on ``model`` (as `goose calibrate`
    would leave it); the cache file as it was afterwards."""
    import goose.verifiers.latency as lat

    path = lat.curve_path(model, verifier)
    before = path.read_text() if path.exists() else None
    lat.write_atomic(path, json.dumps(curve.to_dict()))
    try:
        yield path
    finally:
        if before is None:
            path.unlink()
        else:
            lat.write_atomic(path, before)


def _prompt(n=200, vocab=4096, seed=5):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_deferred_rows_equal_the_rows_the_prefill_would_have_computed():
    model, ids = _tiny_llama(), _prompt()
    eager = _verifier(model, defer_prefill_rows=False).prefill(ids, keep=48)
    lazy_v = _verifier(model)
    first = lazy_v.prefill(ids, keep=48)
    assert first.logits.shape[0] == 1 and lazy_v.deferred_prefill is not None
    assert first.bonus == eager.bonus
    assert lazy_v.stats()["prefill_logit_rows"] == 1
    rows = lazy_v.prefill_rows()
    assert rows is not None and lazy_v.deferred_prefill is None
    assert rows.tokens.tolist() == eager.tokens.tolist() == ids[-48:].tolist()
    assert rows.predecessors.tolist() == eager.predecessors.tolist()
    torch.testing.assert_close(rows.logits, eager.logits, rtol=1e-9, atol=1e-9)
    assert rows.argmax == eager.argmax
    assert lazy_v.stats()["prefill_logit_rows"] == 48
    assert lazy_v.prefill_rows() is None  # taken once


def test_a_generation_that_ends_at_its_first_token_computes_one_row():
    model, ids = _tiny_llama(), _prompt()
    first = int(_verifier(model, defer_prefill_rows=False).prefill(ids, keep=1).bonus)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16)
    out = dec.generate(ids, max_new_tokens=8, stop_token_ids=[first])
    assert out.token_ids == [first]
    assert out.stats.extra["prefill_logit_rows"] == 1
    assert out.stats.extra["tr"]["harvested_positions"] == 1  # the sources still observed the prefill's row
    # a longer one: every row the sources asked for, observed before the first draft
    long = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16).generate(ids, max_new_tokens=8)
    assert long.stats.extra["prefill_logit_rows"] == 200
    assert long.stats.extra["tr"]["harvested_positions"] >= 200


@pytest.mark.parametrize("defer", [True, False])
def test_output_and_drafts_do_not_depend_on_deferral(defer):
    """The sources learn the same rows either way, so trees, passes and output are the same."""
    model, ids = _tiny_llama(), _prompt(seed=7)
    ref = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16,
                        verifier_options={"defer_prefill_rows": False}).generate(ids, max_new_tokens=24)
    out = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16,
                        verifier_options={"defer_prefill_rows": defer}).generate(ids, max_new_tokens=24)
    with torch.inference_mode():
        hf = model.generate(ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                            max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert out.token_ids == ref.token_ids == hf[0, ids.numel():].tolist()
    assert out.stats.forward_passes == ref.stats.forward_passes
    assert out.stats.per_source == ref.stats.per_source


class _Scaled(torch.nn.Module):
    """An output head the forward does not use as it is (as a model with a logit scale would)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        return 2.0 * self.head(h)


def test_a_head_that_does_not_reproduce_the_prefill_row_turns_deferral_off(monkeypatch):
    model, ids = _tiny_llama(), _prompt()
    v = _verifier(model)
    real = model.get_output_embeddings()
    monkeypatch.setattr(model, "get_output_embeddings", lambda: _Scaled(real))
    v.prefill(ids, keep=32)
    assert v.prefill_rows() is None  # the check failed: no rows from a head that is not the model's
    again = v.prefill(ids, keep=32)  # from then on the prefill computes its rows itself
    assert again.logits.shape[0] == 32 and v.deferred_prefill is None


def test_the_loop_still_serves_a_model_whose_head_check_fails(monkeypatch):
    model, ids = _tiny_llama(), _prompt(seed=9)
    real = model.get_output_embeddings()
    monkeypatch.setattr(model, "get_output_embeddings", lambda: _Scaled(real))
    out = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16).generate(ids, max_new_tokens=12)
    with torch.inference_mode():
        hf = model.generate(ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                            max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.token_ids == hf[0, ids.numel():].tolist()
    assert out.stats.extra["tr"]["harvested_positions"] >= 1


class _Slow(torch.nn.Module):
    """The model's own head, 0.25 s slower: a cost that must be counted once, as prefill."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        time.sleep(0.25)
        return self.head(x)


def test_the_deferred_rows_are_timed_as_prefill_not_as_the_sources_harvest(monkeypatch):
    # `goose bench`'s profile adds the verifier's prefill time and the loop's observe time: the
    # deferred rows' head must be in one of them only (the loop once counted it in both)
    model, ids = _tiny_llama(), _prompt(seed=11)
    real = model.get_output_embeddings()
    monkeypatch.setattr(model, "get_output_embeddings", lambda: _Slow(real))
    out = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=16).generate(ids, max_new_tokens=8)
    assert out.stats.extra["prefill_logit_rows"] == 200  # the deferred path ran
    t, vt = out.stats.time_s, out.stats.extra["verifier"]
    assert vt["prefill_forward"] >= 0.25
    assert t["observe"] < 0.25, t
    timed = t["draft"] + t["observe"] + vt["prefill_forward"] + vt["forward"]
    assert timed <= t["total"], (timed, t, vt)


class _Rows(torch.nn.Module):
    """The model's own head, recording how many rows each call computes."""

    def __init__(self, head):
        super().__init__()
        self.head, self.calls = head, []

    def forward(self, x):
        self.calls.append(x.shape[-2])
        return self.head(x)


@pytest.mark.parametrize("keep,run", [(10, 16), (5, 16), (16, 16), (3, 3), (20, 20), (40, 40)])
def test_deferred_rows_run_at_the_cheapest_measured_row_count(monkeypatch, keep, run):
    """A head measured slow from 4 to 15 rows and fast at 16 (Gemma-3-270M's on an AMX Xeon): 10 wanted rows
    are computed as 16 and sliced; 3 and 20, estimated cheaper than any measured count above, as asked; past
    the last measured count, as asked. The rows equal the unpadded ones."""
    from goose.verifiers.latency import LatencyCurve

    curve = LatencyCurve((1,), (0.1,), head=((1, 0.035), (2, 0.04), (4, 0.08), (8, 0.125), (16, 0.08), (32, 0.105)))
    model, ids = _tiny_llama(), _prompt()
    eager = _verifier(model, defer_prefill_rows=False).prefill(ids, keep=keep)
    v = _verifier(model)
    with cached(model, v, curve):  # where the verifier reads it at its prefill
        spy = _Rows(model.get_output_embeddings())
        monkeypatch.setattr(model, "get_output_embeddings", lambda: spy)
        v.prefill(ids, keep=keep)
        rows = v.prefill_rows()
    assert spy.calls[-1] == run and v.stats()["prefill_head_rows"] == run
    assert rows.logits.shape[0] == keep == v.stats()["prefill_logit_rows"]
    assert rows.tokens.tolist() == ids[-keep:].tolist()
    torch.testing.assert_close(rows.logits, eager.logits, rtol=1e-9, atol=1e-9)
    assert rows.argmax == eager.argmax
