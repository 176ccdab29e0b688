"""A real vLLM server for the tests: PyPI's CPU build in ``.venv-vllm`` (``scripts/install_vllm.sh``), started by
``scripts/serve_vllm.sh`` (the README's command; its comments say why each flag) as its own process group, and
stopped by that group's id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, free_port

VENV = REPO / ".venv-vllm"
REQUIRE = "LIGHTNING_DTA_REQUIRE_VLLM"
"""set to 1 (CI does): a missing ``.venv-vllm`` fails the real-server tests instead of skipping them."""
SERVED_NAME = "toy"  # scripts/serve_vllm.sh's --served-model-name


def missing() -> str | None:
    """Why no server can start here (``None``: it can)."""
    if (VENV / "bin" / "python").exists():
        return None
    return f"no vLLM environment at {VENV}: bash scripts/install_vllm.sh creates it"


@dataclass
class VLLMServer:
    url: str
    process: subprocess.Popen
    log: Path
    model_dir: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def write_model(config: Path, out: Path) -> Path:
    """The config's model and tokenizer as the server's starting checkpoint, by the documented script."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "server_model.py"), str(config), str(out)], check=True,
                   cwd=REPO, capture_output=True)
    return out


def start(model_dir: Path, log: Path, timeout: float = 300.0, command: Callable[[int], list[str]] | None = None,
          env: dict[str, str] | None = None) -> VLLMServer:
    """Start the server on a free port and wait for ``/health`` (at most ``timeout`` s; a server that exits first
    fails at once with its log). ``command(port)``: another server's command line (default: the CPU server's
    script), run with ``env`` added to this environment."""
    port = free_port()
    argv = command(port) if command else ["bash", str(REPO / "scripts" / "serve_vllm.sh"), str(model_dir), str(port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=model_dir.parent, stdout=out, stderr=subprocess.STDOUT,
                                   env=os.environ | (env or {}),
                                   start_new_session=True)  # its own process group: stop() ends all of it
    server = VLLMServer(f"http://127.0.0.1:{port}", process, log, model_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1.0)
    stop(server)
    raise RuntimeError(f"the vLLM server did not answer /health within {timeout:.0f} s:\n{server.log_tail()}")


def stop(server: VLLMServer) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after 30 s."""
    try:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
    except ProcessLookupError:
        pass
