"""Goose's tooling, apart from the decoding core in ``goose/`` (nothing in the core imports from here).

- ``cli``: the ``goose`` command (plugins, models, generate, bench, report, tiers, calibrate, theory);
- ``bench``: ``goose bench`` / ``goose report``: methods interleaved per prompt, tables, profiles;
- ``datasets``: the benchmark prompts and the tune / measure splits; ``models``: the real pretrained models
  that install offline, and their loading; ``generate``: ``goose generate``; ``tiers_cmd``: ``goose tiers``;
- ``plots``: the benchmark's figures (matplotlib, optional).
"""
