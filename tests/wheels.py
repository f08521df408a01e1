"""An engine's wheels, as the contract tests read them: found in a cache folder and taken apart
once (tests/sglang_source.py, tests/vllm_source.py). Nothing here imports the engine.

For a package P: wheels in $RLCTL_<P>_WHEELS, else ~/.cache/rlctl/P-wheels (filled with
`pip download --no-deps --only-binary=:all: P==X -d DIR`); files taken out into
$RLCTL_<P>_SRC, else ~/.cache/rlctl/P-src, one folder per wheel and list of patterns.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from fnmatch import fnmatch
from pathlib import Path


class MissingWheel(FileNotFoundError):
    pass


def wheel_dir(package: str) -> Path:
    return Path(os.environ.get(f"RLCTL_{package.upper()}_WHEELS") or Path.home() / f".cache/rlctl/{package}-wheels")


def src_dir(package: str) -> Path:
    return Path(os.environ.get(f"RLCTL_{package.upper()}_SRC") or Path.home() / f".cache/rlctl/{package}-src")


def wheel(package: str, version: str) -> Path:
    """The wheel of `version` in wheel_dir(); MissingWheel, with the command that gets it, if none."""
    found = sorted(wheel_dir(package).glob(f"{package}-{version}-*.whl"))
    if not found:
        raise MissingWheel(f"no {package} {version} wheel in {wheel_dir(package)}: pip download --no-deps "
                           f"--only-binary=:all: {package}=={version} -d {wheel_dir(package)}")
    return found[0]


def extract(package: str, whl: Path, files: tuple[str, ...]) -> Path:
    """The wheel's members matching `files` (fnmatch patterns) taken out, once: into a temporary
    folder renamed into place, so that processes racing here each end with the same complete folder."""
    key = hashlib.sha256(f"{whl.name} {whl.stat().st_size} {files}".encode()).hexdigest()[:10]
    final = src_dir(package) / f"{whl.stem}-{key}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=final.parent))
    try:
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if any(fnmatch(name, pattern) for pattern in files):
                    z.extract(name, partial)
        os.rename(partial, final)
    except OSError:
        if not final.is_dir():  # not another process having renamed its copy first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final
