"""Record real runs for the calibration: ``python -m goose.theory record ...``.

Decodes benchmark prompts with a composed decoder (default: the GOOSE preset, sources pld + tr,
policy spine) and writes one JSON line per verification step (the format of
:mod:`goose.theory.calibrate`), tagged with the dataset. ``check --records`` reads the file.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path


def record_runs(
    datasets: Sequence[str],
    out: str | Path,
    model_name: str = "smollm2",
    num_prompts: int = 5,
    max_new_tokens: int = 128,
    sources: Sequence[str] = ("pld", "tr"),
    policy: str = "spine",
    budget: int = 60,
    data_dir: str | None = None,
    threads: int | None = None,
) -> list:
    import torch

    from goose.tools import models

    caller_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _collect(models.load(model_name), sources, policy, budget, datasets, num_prompts, max_new_tokens,
                        data_dir, out)
    finally:
        torch.set_num_threads(caller_threads)  # the caller's setting, as it was


def _collect(loaded, sources, policy, budget, datasets, num_prompts, max_new_tokens, data_dir, out) -> list:
    import goose
    from goose.tools import datasets as ds
    from goose.theory.calibrate import Recorder, dump_records

    model, tok = loaded
    decoder = goose.compose(model, tok, sources=list(sources), policy=policy, budget=budget)
    recorder = Recorder()
    goose.register_plugin(recorder, name="goose-theory-recorder")
    try:
        t0 = time.time()
        for spec in datasets:
            prompts = ds.load(spec, data_dir)[:num_prompts]
            recorder.set_dataset(spec)
            for k, p in enumerate(prompts):
                ids = tok(p.text, return_tensors="pt")["input_ids"]
                out_ = decoder.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
                print(f"{spec} {k + 1}/{len(prompts)}: tau {out_.stats.tau:.2f} ({time.time() - t0:.0f}s)", file=sys.stderr)
    finally:
        goose.unregister_plugin("goose-theory-recorder")
    dump_records(recorder.records, out)
    return recorder.records
