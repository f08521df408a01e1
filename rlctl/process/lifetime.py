"""A process that lives no longer than its parent (Linux's PR_SET_PDEATHSIG).

Every process of a run is started so that it dies with the process that started it: the
supervisor's children, the pool's engines, and the controller's scoring workers. A SIGKILL of the
supervisor then takes the whole tree with it, instead of leaving a controller, its workers and
their resource tracker running for nobody.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """From now on this process gets SIGKILL when its parent dies. `parent`: the pid the caller
    expects as its parent; if that one is already gone (it died before this call, and the process
    has been handed to another), exit at once instead of living on as an orphan."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)
