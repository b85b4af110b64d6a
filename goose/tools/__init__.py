"""Goose's tooling, apart from the decoding core in ``goose/`` (nothing in the core imports from here): the ``goose``
command (``cli``), ``goose bench`` / ``goose report`` (``bench``) and their prompts (``datasets``), the offline models
(``models``), ``goose generate`` (``generate``), ``goose tiers`` (``tiers_cmd``) and the figures (``plots``)."""
