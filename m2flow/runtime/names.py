"""Names and addresses the runtime's modules share: the Ray namespace of every actor, the
prefix of a session's shared-memory segments and pipes, and a free TCP port.

Imports nothing of m2flow, so that any runtime module can import it.
"""

from __future__ import annotations

import socket

NAMESPACE = "m2flow"


def shm_prefix(session: str) -> str:
    return f"m2flow-{session}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
