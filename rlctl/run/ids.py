"""Run ids, `<name>-<date>-<time>-<suffix>`, and the directory each names: no two runs get one.

The suffix is 32 random bits (8 hex digits; runs made before had 16, 4 digits, and are still
recognized). Random bits alone leave a chance of two launches in one second drawing one suffix
(a sweep starts hundreds of runs within seconds), so a run's directory is created with mkdir,
which fails when the path exists, in this process or any other, on this host or another host
of a shared filesystem; on that failure a new suffix is drawn.
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets
from pathlib import Path

from rlctl.errors import RunError

RUN_ID = re.compile(r"^[^/]+-\d{8}-\d{6}-(?:[0-9a-f]{8}|[0-9a-f]{4})$")
"""What new_run_id makes (and made, with a 4-digit suffix): `<name>-<date>-<time>-<suffix>`."""
SUFFIX_BYTES = 4
CREATE_TRIES = 64
"""New suffixes drawn before giving up: only a directory that refuses every new entry uses them."""


def new_run_id(name: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(SUFFIX_BYTES)}"


def make_run_path(output_dir: Path, name: str) -> tuple[str, Path]:
    """A new run id and its directory under output_dir, created (mode 0700) and the run's alone:
    an id whose directory exists already is drawn again."""
    for _ in range(CREATE_TRIES):
        run_id = new_run_id(name)
        path = output_dir / run_id
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return run_id, path
    raise RunError(
        f"{output_dir}: no new run directory after {CREATE_TRIES} tries (every name drawn exists); check the directory"
    )
