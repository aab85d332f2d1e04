"""Processes and ports: a free loopback port, a child that dies with its parent, and
whether a pid is alive."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_of(parent_pid: int, sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that started it dies.

    Run in the forked child before exec. It also unblocks every signal (the
    supervisor blocks SIGINT, SIGTERM and SIGCHLD to take them synchronously, and
    a child inherits the mask across exec), and exits at once if the parent died
    between the fork and the prctl, which the prctl alone would miss.
    """

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if sys.platform.startswith("linux"):
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig))
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
