#!/usr/bin/env bash
# The wheels `make bench-gpu` needs on a bare GPU machine that has torch but not the project's
# small pure-Python dependencies (hydra-core, omegaconf, antlr4-python3-runtime: pure Python,
# any Python 3), made here into .whl/ (git-ignored through .git/info/exclude, never committed).
# There, before the bench:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m bench.gpu --out .bench/gpu.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
# antlr4-python3-runtime 4.9.3 (the version hydra-core 1.3 pins) is published as an sdist
# only: `pip wheel` builds its pure-Python wheel here, where setuptools can be fetched.
python3 -m pip wheel --quiet --no-deps -w .whl hydra-core==1.3.2 omegaconf==2.3.0 \
  antlr4-python3-runtime==4.9.3 2>&1 | grep -v "^WARNING: Location" || true
ls .whl
