"""Record real runs for the calibration (``python -m goose.theory record ...``): one JSON line per
verification step (the format of :mod:`goose.theory.calibrate`), tagged with the dataset."""

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
    """Decode ``num_prompts`` prompts of each dataset with a composed decoder, write the step records to
    ``out`` and return them; ``threads`` applies while it runs (the caller's torch setting is restored)."""
    import torch

    import goose
    from goose.theory.calibrate import Recorder, dump_records
    from goose.tools import datasets as ds
    from goose.tools import models

    caller_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    recorder = Recorder()
    try:
        model, tok = models.load(model_name)
        decoder = goose.compose(model, tok, sources=list(sources), policy=policy, budget=budget)
        goose.register_plugin(recorder, name="goose-theory-recorder")
        try:
            t0 = time.time()
            for spec in datasets:
                prompts = ds.load(spec, data_dir)[:num_prompts]
                recorder.set_dataset(spec)
                for k, p in enumerate(prompts):
                    ids = tok(p.text, return_tensors="pt")["input_ids"]
                    res = decoder.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
                    print(f"{spec} {k + 1}/{len(prompts)}: tau {res.stats.tau:.2f} ({time.time() - t0:.0f}s)",
                          file=sys.stderr)
        finally:
            goose.unregister_plugin("goose-theory-recorder")
    finally:
        torch.set_num_threads(caller_threads)  # the caller's setting, as it was
    dump_records(recorder.records, out)
    return recorder.records
