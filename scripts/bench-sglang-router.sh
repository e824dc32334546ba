#!/usr/bin/env bash
# pdnode's SGLang drop-in router next to sglang-router 0.3.2, both in front of the same mock
# SGLang PD workers (zero-time; a process of their own), and a client that dispatches to the
# workers itself (the floor). Prints one markdown table (docs/benchmarks.md records it).
#
#   scripts/bench-sglang-router.sh [--requests N] [--out FILE.json]
#
# Needs network once: sglang-router==0.3.2 from PyPI into .cache/sglang-router-0.3.2 (a venv).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/sglang-router-0.3.2
if ! "$venv/bin/python" -c 'import sglang_router' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q 'sglang-router==0.3.2'
fi
version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang-router"))')
[ "$version" = 0.3.2 ] || { echo "expected sglang-router 0.3.2 in $venv, found $version" >&2; exit 1; }
cargo build --release -q -p pdnode
echo "commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty'), $(nproc) cores, $(uname -r)"
exec cargo bench -q -p pdnode-sglang --bench vs_sglang_router -- \
    --pdnode "$PWD/target/release/pdnode" --python "$PWD/$venv/bin/python" "$@"
