#!/usr/bin/env bash
# The README's test command with every core kept busy by another process: the suite must pass there, only slower.
#
#   ci/busy_run.sh [EXTRA PYTEST ARGS...]      PYTHON=.venv/bin/python ci/busy_run.sh --durations=20
#   TESTS="tests/suite/test_cli.py tests/harness/test_harness.py" ci/busy_run.sh      (some files instead of tests/)
#
# Starts one busy loop per core (nproc), runs `python -m pytest -n 2 -q tests`, stops the loops (on any exit,
# Ctrl-C included; each loop also ends by itself after BUSY_LIMIT_S, default 3 h) and prints the time taken.
# The exit status is pytest's. See docs/TESTING.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
cores=$(nproc)
loops=()

stop_loops() {
  for pid in "${loops[@]}"; do
    kill "$pid" 2>/dev/null
  done
  wait "${loops[@]}" 2>/dev/null
}
trap stop_loops EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$cores"); do
  timeout "${BUSY_LIMIT_S:-10800}" sh -c 'while :; do :; done' &
  loops+=("$!")
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever the environment installed
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
start=$(date +%s)
# shellcheck disable=SC2086  # TESTS is a list of paths
"$python" -m pytest -n 2 -q ${TESTS:-tests} "$@"
status=$?
took=$(( $(date +%s) - start ))
echo "busy_run: pytest exited $status after ${took} s beside $cores busy loops" \
     "(commit $commit at the start, ended $(date -u +%Y-%m-%dT%H:%MZ), $cores cores)"
exit "$status"
