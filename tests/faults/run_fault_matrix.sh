#!/usr/bin/env bash
# Run the whole fault matrix: the fast subset (default CI), the slow crash matrix, the I/O
# error positions. Prints the number of cases run and how each group ended.
#   tests/faults/run_fault_matrix.sh            # everything under tests/faults
#   tests/faults/run_fault_matrix.sh -x -v      # extra pytest arguments are passed through
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
rc=0
for sel in "not slow" "slow"; do
  echo "== tests/faults -m \"$sel\""
  start=$(date +%s)
  out=$(python -m pytest -q -p no:cacheprovider tests/faults -m "$sel" "$@" 2>&1)
  r=$?
  echo "$out" | grep -E "^(FAILED|ERROR|XPASS)" || true
  summary=$(echo "$out" | tail -n 1)
  echo "   $summary   [$(( $(date +%s) - start ))s]"
  [ $r -eq 0 ] || rc=$r
done
echo "== cases in the matrix: $(python -m pytest -q -p no:cacheprovider --co tests/faults 2>/dev/null | grep -c '::')"
exit $rc
