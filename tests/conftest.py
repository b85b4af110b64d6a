import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(int(os.environ.get("GOOSE_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _fresh_plugin_state():
    """Every test sees the registry as installed, whatever earlier tests registered."""
    import goose.manager

    goose.manager.reset()
    yield
    goose.manager.reset()


@pytest.fixture(autouse=True)
def _latency_cache_in_tmp(tmp_path_factory, monkeypatch):
    """Latency curves measured by tests go to a temporary folder, not the user's cache."""
    import goose.verifiers.latency

    d = tmp_path_factory.getbasetemp() / "latency"
    monkeypatch.setattr(goose.verifiers.latency, "cache_dir", lambda: d)
