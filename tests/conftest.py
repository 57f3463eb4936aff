"""Shared fixtures: tiny generated checkpoints (real layouts) and the shared trained model."""

from __future__ import annotations

import os
import subprocess
import sys
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


def run_in_fresh_interpreter(test_file: str) -> None:
    """Run a Triton test module again in a subprocess with TRITON_INTERPRET=1, for a process in which triton was
    imported (compiled mode, no GPU) before the module could set the flag; fails with the subprocess's output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", test_file]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def triton_interpreter_guard() -> bool:
    """Call at the top of a Triton test module, before it imports triton. Without a GPU it sets TRITON_INTERPRET=1
    (Triton reads it when a `@triton.jit` decorator runs). Returns True when that is too late: triton is already
    imported in compiled mode without a GPU (compressed_tensors imports it, so a module collected earlier can). The
    flag is then left unset, so that every Triton module sees the same and reruns itself in a subprocess
    (`run_in_fresh_interpreter`); setting it now would make a later module take it for working."""
    import torch

    too_early = not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    if not torch.cuda.is_available() and not too_early:
        os.environ["TRITON_INTERPRET"] = "1"
    return too_early


def skip_if_triton_too_early(too_early: bool, rerun_test: str):
    """An autouse fixture for a Triton test module: when `too_early`, skip its tests except `rerun_test`, the one
    that reruns the module in a fresh interpreter."""

    @pytest.fixture(autouse=True)
    def _runnable(request):
        if too_early and request.node.originalname != rerun_test:
            pytest.skip(f"triton was imported before TRITON_INTERPRET=1 could be set; see {rerun_test}")

    return _runnable
