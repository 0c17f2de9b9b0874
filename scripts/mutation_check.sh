#!/usr/bin/env bash
# The mutation check (scripts/mutation_check.py): break the library one line
# at a time in a temporary copy and run the tests that should notice; exits 1
# if a break survives. No arguments: the full list (the benchmark tier);
# --ci: the short list the test command runs (tests/repo/test_mutation.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/mutation_check.py "$@"
