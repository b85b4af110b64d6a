"""benchmarks/vllm_serving.py's closed loop: c requests in flight, each one that finishes replaced by the next
prompt, the outputs returned in the prompts' order. A fake engine serves: no vLLM needed."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

spec = importlib.util.spec_from_file_location("vllm_serving", Path(__file__).parents[1] / "benchmarks" / "vllm_serving.py")
vs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs)


class FakeEngine:
    """Each step every running request gets ``rate[prompt[0]]`` tokens (1 unless given: requests of a
    speculating engine move at their own pace) until it has ``max_tokens``; a finished one leaves at the end of
    the step. ``flying`` records how many requests ran in each step."""

    def __init__(self, rate, max_tokens=6):
        self.rate, self.max_tokens = rate, max_tokens
        self.running: dict = {}  # id -> [prompt, tokens]
        self.flying: list[int] = []

    def add_request(self, rid, prompt, sp):
        self.running[rid] = [prompt["prompt_token_ids"], [], getattr(sp, "max_tokens", self.max_tokens)]

    def step(self):
        self.flying.append(len(self.running))
        outs = []
        for rid, (prompt, toks, most) in list(self.running.items()):
            n = min(most - len(toks), self.rate.get(prompt[0], 1))
            toks.extend(prompt[0] * 100 + i for i in range(len(toks), len(toks) + n))
            done = len(toks) >= most
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=list(toks))]))
            if done:
                del self.running[rid]
        return outs


def test_c_requests_stay_in_flight_until_the_prompts_run_out_and_outputs_come_back_in_order():
    eng = FakeEngine({2: 3, 4: 2})  # request 2 finishes first, request 4 before 3
    out = vs.closed_loop(SimpleNamespace(llm_engine=eng), [[i] for i in range(7)], None, 3)
    assert out == [[p * 100 + i for i in range(6)] for p in range(7)]  # the prompts' order, not the finishing order
    last = max(i for i, n in enumerate(eng.flying) if n == 3)  # 3 in flight until the prompts run out, then fewer
    assert set(eng.flying[: last + 1]) == {3} and all(n < 3 for n in eng.flying[last + 1 :])
    assert sum(eng.flying) == 5 * 6 + 2 + 3  # request-steps: 6 each, request 2 (3 tokens a step) 2, request 4 (2 a step) 3


def test_each_prompt_gets_its_own_length_the_same_for_every_engine():
    got = vs.lengths(400, 64, 0.5)
    assert got == vs.lengths(400, 64, 0.5)  # seeded by place: every engine and phase decodes the same lengths
    assert min(got) >= 32 and max(got) <= 96 and len(set(got)) > 40  # spread over the range, not one value
    assert abs(sum(got) / len(got) - 64) < 3  # the mean stays max_tokens
    assert vs.lengths(5, 64, 0.0) == [64] * 5
    sps = [SimpleNamespace(max_tokens=m) for m in vs.lengths(7, 6, 0.5)]
    eng = FakeEngine({})
    out = vs.closed_loop(SimpleNamespace(llm_engine=eng), [[i] for i in range(7)], sps, 3)
    assert [len(o) for o in out] == [sp.max_tokens for sp in sps]  # each prompt's own, in the prompts' order
    assert len({len(o) for o in out}) > 1


def test_the_suffix_install_script_refuses_an_environment_without_vllm():
    """benchmarks/vllm_suffix_install.sh builds into the environment it is given: one that cannot import vLLM is
    refused before anything is downloaded, with the path, what is allowed and where the steps are."""
    import importlib.util as iu
    import subprocess
    import sys

    import pytest

    if iu.find_spec("vllm") is not None:
        pytest.skip("this environment is a vLLM one: the script would build into it")
    script = Path(__file__).parents[1] / "benchmarks" / "vllm_suffix_install.sh"
    out = subprocess.run(["bash", str(script), sys.prefix], capture_output=True, text=True)
    assert out.returncode == 2, out
    assert "is not a vLLM environment" in out.stderr and sys.prefix in out.stderr and "docs/vllm.md" in out.stderr
