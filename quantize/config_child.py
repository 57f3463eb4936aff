"""The child process that builds the compressed-tensors `quantization_config` (`glmq.formats.compressed_tensors`).

Importing compressed-tensors imports transformers: seconds of start-up (4-5 s on this project's CPU machine,
14-19 s measured on the H200 machine) that would otherwise hold the GIL the conversion needs. The child does
that import at once and then waits for its request on stdin, so starting it as the first thing `glmq quantize`
does overlaps the import with the parent's own start-up (torch, the plan, CUDA) as well as with the
conversion. This module imports nothing heavy, so that the CLI can call `prestart` before anything else.
"""

from __future__ import annotations

import atexit
import importlib.util
import subprocess
import sys

# the child's own peak resident set, which it writes beside the config (`ConfigJob.result` pops it for the report)
PEAK_KEY = "_glmq_child_peak_rss_bytes"

_STARTED: list[tuple[subprocess.Popen, bool]] = []


def spawn(own_session: bool = False) -> subprocess.Popen:
    """A fresh child. own_session: start it in its own session (torchrun ranks; see `output.ConfigJob`)."""
    return subprocess.Popen([sys.executable, "-m", "glmq.formats.compressed_tensors"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=own_session)


def prestart(own_session: bool = False) -> None:
    """Start the child now; the next `take` hands it over. Killed at exit if nothing took it."""
    if not _STARTED:
        proc = spawn(own_session)
        _STARTED.append((proc, own_session))
        atexit.register(kill, proc)


class ConfigChildError(ValueError):
    """The child cannot build the config: raised when the run starts, not after the conversion it would end."""


def take(own_session: bool = False) -> subprocess.Popen:
    """The prestarted child (if started with the same session choice), else a fresh one.

    Raises:
        ConfigChildError: compressed-tensors is not installed, or the prestarted child already failed (its import
            did: a fresh child's would too). The child reads its request only after the conversion, so without this
            check the whole conversion (or, with GPTQ, the writer after the calibration) ran before the error.
    """
    if _STARTED and _STARTED[0][1] == own_session:
        proc = _STARTED.pop()[0]
        if proc.poll() is None:
            return proc
        if proc.returncode > 0:  # killed by a signal (< 0): a fresh one may do; an error exit is the import's
            err = proc.stderr.read() if proc.stderr else ""
            raise ConfigChildError(f"the child building the compressed-tensors config (python -m "
                                   f"glmq.formats.compressed_tensors) failed at start-up, exit code {proc.returncode}; "
                                   f"fix the installation and run again:\n{err[-3000:]}")
    if importlib.util.find_spec("compressed_tensors") is None:
        raise ConfigChildError("compressed-tensors is not installed; glmq writes the output's quantization_config "
                               "with it: pip install 'compressed-tensors>=0.12,<0.21'")
    return spawn(own_session)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
