#!/usr/bin/env bash
# The fast test tier in a virtualenv made from nothing, against the newest releases the package
# index serves (what a new user's `pip install -e '.[local,test]'` gets today), not what this
# machine happens to hold. docs/testing.md says when to run it.
#
#   bash scripts/check_fresh.sh [pytest args]     # e.g. -x, or -k recipe
#
# RLCTL_FRESH_VENV=DIR keeps the virtualenv there (default: a temporary one, removed at the end).
# torch is the one pin: the CPU build of torch 2.13.0 (scripts/run-tests.sh installs the same).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${RLCTL_FRESH_VENV:-}"
if [ -z "$venv" ]; then
  venv="$(mktemp -d)/venv"
  trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q -e '.[local,test]'

echo "fresh virtualenv: $venv"
"$py" - <<'EOF'
from importlib.metadata import version
for name in ("PyYAML", "omegaconf", "transformers", "typer", "rich", "click", "torch", "safetensors",
             "aiohttp", "math-verify", "pytest"):
    print(f"  {name:<14} {version(name)}")
EOF
"$py" -m pytest -q -m fast -p no:cacheprovider "$@"
