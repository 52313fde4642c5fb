#!/usr/bin/env bash
# The one command for a GPU machine (docs/gpu.md): installs the wheels of .whl/ (`make gpu-wheels`), if there are
# any, into a temporary folder ahead of the machine's own packages, then runs scripts/gpu/check.py with the
# arguments given here. Results go to $OUT (or --out DIR). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
site=""
if compgen -G ".whl/*.whl" > /dev/null; then
  site=$(mktemp -d /tmp/lit_growattn_wheels.XXXXXX)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
fi
export PYTHONPATH="${site:+$site:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
echo "wheels: ${site:-none (.whl/ is empty: the installed packages are used)}"
exec "$PYTHON" scripts/gpu/check.py "$@"
