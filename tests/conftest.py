"""Shared fixtures: tiny generated checkpoints (real layouts) and the shared trained model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GLMQ_SHARED", REPO.parent / "shared"))
SHARED_MODEL = SHARED / "models" / "glm4moe-prose-fp8"


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """Factory: (family, source_format, **kw) -> path of a tiny generated checkpoint (cached)."""
    from glmq.formats import fixtures

    cache: dict = {}

    def make(family: str = "glm_moe_dsa", source_format: str = "fp8-block", **kw) -> Path:
        key = (family, source_format, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{source_format}")
            cache[key] = fixtures.make_checkpoint(out / "ckpt", family, preset="tiny", source_format=source_format, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def shared_model() -> Path:
    if not (SHARED_MODEL / "config.json").exists():
        pytest.skip(f"shared model not found at {SHARED_MODEL} (set GLMQ_SHARED)")
    return SHARED_MODEL
