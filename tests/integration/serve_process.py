"""``polykv serve`` as a user runs it: the launcher in a process of its own, for the tests that need the launcher
itself (its ready line, its pool cache, its warnings), not only the server it starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from polykv_py.llama_server import free_port

#: ``polykv -v serve`` in a process of its own, its log lines stamped with the time they were written
#: (``-v`` keeps httpx's line per request the launcher sends; the root logger set up here stays at INFO,
#: so ``-v``'s DEBUG level, set up later only if nothing is yet, does not apply)
LAUNCHER = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, format='%(created).6f %(levelname)s %(name)s: %(message)s')\n"
    "from polykv_py.cli import main\n"
    "sys.exit(main(sys.argv[1:]))"
)
#: httpx's line for a request the launcher sent: its time, method and path.
REQUEST_LINE = re.compile(r"^(?P<t>\d+\.\d+) INFO httpx: HTTP Request: (?P<method>[A-Z]+) http://[^/]+(?P<path>\S*) ")


@contextmanager
def polykv_serve(*args: str) -> Iterator[tuple[str, list[str]]]:
    """``polykv -v serve ARGS`` on a free port in its own process; yields its URL and the lines it prints (a
    thread keeps reading them, so the list grows while the launcher runs). Stopped with SIGTERM: it must exit 0."""
    port = free_port()
    argv = [sys.executable, "-c", LAUNCHER, "-v", "serve", "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "polykv serve: ready at" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not ready.wait(0.5):
            if proc.poll() is not None:
                reader.join(10)
                raise AssertionError("polykv serve ended before it was ready:\n" + "\n".join(lines))
        yield f"http://127.0.0.1:{port}", lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
            reader.join(10)
        assert proc.returncode == 0, "\n".join(lines[-40:])
