#!/usr/bin/env bash
# The full test command (README, .ci/run): install rlctl with its test extras, bring up the
# project's own 3-node Slurm test cluster (as root; scripts/slurm-test-cluster.sh), run every tier
# of the suite (docs/testing.md) with the 30 slowest tests listed, and stop the cluster again
# whatever happened. Arguments go to pytest.
# Not root: the Slurm tests are skipped (they need network namespaces and slurmd).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q torch==2.13.0
# --upgrade: rlctl's own dependencies at the newest releases the index serves, as a new user's
# install gets them, not whatever older release this machine already holds.
python3 -m pip install -q --upgrade -e '.[local,test]'

# SGLang's wheels of the supported releases: the contract tests read their source (tests/sglang_source.py);
# nothing imports them. About 80 MB, downloaded once.
wheels="${RLCTL_SGLANG_WHEELS:-$HOME/.cache/rlctl/sglang-wheels}"
for version in 0.5.15.post1 0.5.21 0.5.23; do
  if ! compgen -G "$wheels/sglang-$version-*.whl" >/dev/null; then
    python3 -m pip download -q --no-deps --only-binary=:all: "sglang==$version" -d "$wheels"
  fi
done

# vLLM's wheels of the supported releases, the same way for its contract tests (tests/vllm_source.py).
# About 240-340 MB each, downloaded once.
wheels="${RLCTL_VLLM_WHEELS:-$HOME/.cache/rlctl/vllm-wheels}"
for version in 0.33.0 0.34.0; do
  if ! compgen -G "$wheels/vllm-$version-*.whl" >/dev/null; then
    python3 -m pip download -q --no-deps --only-binary=:all: "vllm==$version" -d "$wheels"
  fi
done

# Megatron-core's wheel, the same way for the Megatron trainer's contract tests
# (tests/megatron_source.py). A cp312 wheel (2.4 MB): --python-version fetches it on any Python.
wheels="${RLCTL_MEGATRON_CORE_WHEELS:-$HOME/.cache/rlctl/megatron_core-wheels}"
if ! compgen -G "$wheels/megatron_core-0.19.2-*.whl" >/dev/null; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "megatron-core==0.19.2" -d "$wheels"
fi

if [ "$(id -u)" = 0 ]; then
  # The scripts' linter (shellcheck); bubblewrap and a system Python for the python tool's sandbox
  # (tests/test_sandbox.py; rlctl/agents/sandbox.py runs the system's Python, which `nobody` can read)
  missing=()
  command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
  command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
  [ -x /usr/bin/python3 ] || missing+=(python3-minimal)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  trap 'scripts/slurm-test-cluster.sh stop' EXIT
  # start prints `export SLURM_CONF=...`. Taken into a variable first: `eval "$(start)"` would run
  # the tests with no SLURM_CONF when start fails, and every Slurm test would fail on sbatch's
  # "Could not establish a configuration source" with the reason scrolled away. A start that
  # fails is stopped and tried once more; a second failure ends here, naming the daemons' logs.
  start_cluster() {
    local exports
    exports=$(scripts/slurm-test-cluster.sh start) || {
      echo "[run-tests] the Slurm test cluster did not start; the end of its logs:" >&2
      tail -n 15 "${RLCTL_SLURM_DIR:-/tmp/rlctl-slurm}"/log/*.log >&2 2>/dev/null || true
      return 1
    }
    eval "$exports"
  }
  if ! start_cluster; then
    scripts/slurm-test-cluster.sh stop || true
    start_cluster || { echo "error: the Slurm test cluster did not start twice; see above" >&2; exit 1; }
  fi
  [ -r "${SLURM_CONF:-}" ] || { echo "error: the Slurm test cluster gave no readable SLURM_CONF" >&2; exit 1; }
  export RLCTL_SLURM_TESTS=1
fi
# Two workers (RLCTL_TEST_WORKERS), a module or the Slurm group at a time (tests/conftest.py).
python3 -m pytest -q --durations=30 -n "${RLCTL_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
