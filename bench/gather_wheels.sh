#!/usr/bin/env bash
# Gather what a bare GPU image lacks for bench/gpu_check.sh (and training) into one folder, for a GPU
# machine without network. Run it here, where PyPI is reachable and truneg's venv is installed:
#
#   bash bench/gather_wheels.sh [DIR] [--present FILE]      # DIR default: .cache/gpu_wheels (git-ignored)
#
# DIR then holds:
#   - deepspeed-<v>-py3-none-any.whl: a pure-Python wheel built from PyPI's source archive of the installed
#     version (PyPI has no wheel); its CUDA ops (FusedAdam, FusedLamb) build just in time with the GPU
#     machine's nvcc;
#   - Python 3.12 manylinux x86_64 wheels of everything deepspeed, datasets and nltk need besides torch,
#     each pinned to the version installed here (the one truneg is tested with);
#   - nltk_data.tar.gz: the WordNet corpus as truneg/synonyms/wordnet.py installed it here;
#   - requirements.txt (what gpu_check.sh installs) and pins.txt (name==version of every wheel).
# --present FILE: a `pip freeze` (or one name a line) of the target image; a package it already holds in a
# version that satisfies every requirement on it gets no wheel, which keeps DIR small.
# On the GPU machine: python3 -m pip install --no-index --find-links DIR -r DIR/requirements.txt
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=.cache/gpu_wheels
PRESENT=
while [ $# -gt 0 ]; do
  case "$1" in
    --present) PRESENT=$2; shift 2 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) DIR=$1; shift ;;
  esac
done
set -euo pipefail
mkdir -p "$DIR"
DS_VERSION=$("$PY" -c "from importlib.metadata import version; print(version('deepspeed'))")

echo "== deepspeed $DS_VERSION: pure-Python wheel from the source archive"
if ! ls "$DIR"/deepspeed-"$DS_VERSION"-*.whl >/dev/null 2>&1; then
  # --no-build-isolation: setup.py imports torch, which is installed here; DS_BUILD_OPS unset: no op is
  # prebuilt, they build just in time where they run.
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "deepspeed==$DS_VERSION"
fi

echo "== the closure of deepspeed, datasets and nltk for Python 3.12 (torch excluded: the image has it)"
"$PY" - "$DIR/pins.txt" "$PRESENT" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

out, present_file = sys.argv[1], sys.argv[2]
ROOTS, EXCLUDED = ["deepspeed", "datasets", "nltk"], {"torch"}
env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "implementation_name": "cpython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64"}
present = {}
if present_file:
    for line in open(present_file):
        name, _, ver = line.strip().partition("==")
        if name and not name.startswith("#"):
            present[canonicalize_name(name.split(" @ ")[0])] = ver or None
specs: dict[str, SpecifierSet] = {canonicalize_name(r): SpecifierSet() for r in ROOTS}
queue, seen = [(r, frozenset()) for r in ROOTS], set()
while queue:
    name, extras = queue.pop()
    if (name, extras) in seen:
        continue
    seen.add((name, extras))
    try:
        requires = distribution(name).requires or []
    except PackageNotFoundError:
        continue
    for text in requires:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
            continue
        dep = canonicalize_name(req.name)
        if dep in EXCLUDED:
            continue
        specs[dep] = specs.get(dep, SpecifierSet()) & req.specifier
        queue.append((dep, frozenset(req.extras)))
pins, skipped = [], []
for name in sorted(specs):
    # A name without a version is taken to satisfy every bound: with a wheel for each bounded one the H200
    # folder would be 78 MB, over what the device tool carries (64 MiB); gpu_check.sh falls back to --no-deps.
    if name in present and (present[name] is None or specs[name].contains(present[name], prereleases=True)):
        skipped.append(name)
        continue
    try:
        pins.append(f"{name}=={distribution(name).version}")
    except PackageNotFoundError:  # needed on 3.12 but not installed here: let pip choose
        pins.append(f"{name}{specs[name]}")
open(out, "w").write("\n".join(pins) + "\n")
print(f"{len(pins)} wheels to fetch; the image already has {len(skipped)}: {' '.join(skipped) or '-'}")
PYEOF
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 5 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
grep -v "^deepspeed==" "$DIR/pins.txt" > "$DIR/.download.txt" || true
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DIR" -r "$DIR/.download.txt"
rm -f "$DIR/.download.txt"
printf '%s\n' deepspeed datasets nltk > "$DIR/requirements.txt"

echo "== WordNet for nltk"
WORDNET=$("$PY" -c "import nltk; print(nltk.data.find('corpora/wordnet'))")
tar -czf "$DIR/nltk_data.tar.gz" -C "$(dirname "$(dirname "$WORDNET")")" corpora/wordnet

echo "== $DIR: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1)"
