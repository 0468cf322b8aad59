#!/usr/bin/env bash
# The wheels `make bench-gpu` needs on a bare GPU machine that has torch but not the project's
# small dependencies (hydra-core, omegaconf, antlr4-python3-runtime: pure Python, any Python 3;
# psutil: one wheel for any CPython 3 on x86-64 Linux), made here into .whl/ (git-ignored
# through .git/info/exclude, never committed).
#
#   bash bench/gpu_wheels.sh                      hydra-core, omegaconf, antlr4, psutil (~0.8 MB)
#   bash bench/gpu_wheels.sh --tracking HAVE.txt  and MLflow and submitit, for CPython 3.12 on
#                                                 x86-64 Linux, less what the GPU machine has
#
# HAVE.txt names the packages the GPU machine already holds (`python3 -m pip list
# --format=freeze` there, or one name per line): MLflow with all its dependencies is ~180 MB of
# wheels, the ones a machine with torch, pandas, scikit-learn and pyarrow lacks ~36 MB. Without
# MLflow the bench's gpt/service-mlflow arm is skipped, with its reason. There, before the bench:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m bench.gpu --out .bench/gpu.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
have=""
if [[ "${1:-}" == "--tracking" ]]; then
  have="${2:?--tracking needs the file of packages the GPU machine has}"
  have="$(realpath "$have")"
fi
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
quiet() { grep -v "^WARNING: Location" || true; }
# antlr4-python3-runtime 4.9.3 (the version hydra-core 1.3 pins) is published as an sdist
# only: `pip wheel` builds its pure-Python wheel here, where setuptools can be fetched.
python3 -m pip wheel --quiet --no-deps -w .whl hydra-core==1.3.2 omegaconf==2.3.0 \
  antlr4-python3-runtime==4.9.3 2>&1 | quiet
all=$(mktemp -d)
trap 'rm -rf "$all"' EXIT
# The same versions as the project's own environment where it has one.
pinned() {
  local version
  version=$({ .venv/bin/python -m pip show "$1" 2>/dev/null || true; } | sed -n 's/^Version: //p')
  echo "$1${version:+==$version}"
}
wanted=("$(pinned psutil)")
[[ -n "$have" ]] && wanted+=("$(pinned mlflow)" "$(pinned submitit)")
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$all" "${wanted[@]}" 2>&1 | quiet
# A wheel's project name, normalised as pip lists it (PEP 503): lower case, '-' for '_' and '.'.
norm() { tr 'A-Z_.' 'a-z--'; }
present=$([[ -z "$have" ]] || sed 's/[=<> ].*//' "$have" | norm | sort -u)
for wheel in "$all"/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1 | norm)
  grep -qx "$name" <<<"$present" || cp "$wheel" .whl/
done
ls .whl
du -sh .whl
