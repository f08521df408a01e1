"""The rows of a prompt file, as the field keeps them: JSON lines, Parquet (verl's layout among
others), or a dataset written by Hugging Face datasets' `save_to_disk` (a directory of Arrow
files). Each row is a dict of plain Python values; what the fields mean is rlctl/data/prompts.py's
business.

Parquet and Arrow are read with pyarrow (`pip install 'rlctl[data]'`), imported only for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlctl.errors import UsageError


class DataError(UsageError):
    """A data file rlctl cannot use: names the file, the row and the fix (exit 2)."""


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(row number, row) for every row of the file or dataset directory at `path`, numbered
    from 1 as a user counts them (a JSONL row's number is its line's)."""
    if path.is_dir():
        return list(enumerate(_arrow_dir(path), 1))
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return list(enumerate(_parquet(path), 1))
    if suffix in (".jsonl", ".json"):
        return list(_jsonl(path))
    raise DataError(f"{path}: rlctl reads .jsonl, .parquet and save_to_disk directories, not '{suffix or path.name}'; "
                    "convert it or give one of those")


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: a JSON {type(row).__name__}, not an object; each line must be one "
                                "JSON object") from None
            yield lineno, row


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError(f"{path}: reading Parquet and Arrow needs pyarrow; pip install 'rlctl[data]'") from None
    import pyarrow

    return pyarrow


def _parquet(path: Path) -> list[dict[str, Any]]:
    pa = _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a Parquet file pyarrow can read ({e}); fix or rewrite it") from None


def _arrow_dir(path: Path) -> list[dict[str, Any]]:
    """A Dataset's save_to_disk directory: state.json names its Arrow files (IPC streams) in order."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{path}: a DatasetDict with splits {splits}; give one split's directory "
                        f"(e.g. {path / (splits[0] if splits else 'train')})")
    state = path / "state.json"
    if not state.is_file():
        raise DataError(f"{path}: a directory without state.json, not a dataset saved with save_to_disk; give a "
                        "file or such a directory")
    pa = _pyarrow(path)
    try:
        files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        rows: list[dict[str, Any]] = []
        for file in files:
            with pa.memory_map(str(file)) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
    except (KeyError, TypeError, ValueError, OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a save_to_disk dataset rlctl can read ({type(e).__name__}: {e}); save it "
                        "again with datasets' save_to_disk") from None
    return rows
