#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what is missing, fetches the demo model, then
# checks formatting, lints and runs every test of the workspace, then the cluster system tests
# (tests/cluster/run.sh --quick, as root). Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

step() { echo; echo "==> $*" >&2; }

step "setup"
bash scripts/setup.sh
if ! command -v cargo >/dev/null 2>&1; then export PATH="$HOME/.cargo/bin:$PATH"; fi

step "fetch model"
bash scripts/fetch-model.sh

step "fetch NVRTC (the CUDA kernels are compiled by the tests; no GPU needed)"
bash scripts/fetch-nvrtc.sh

# A one-shot build (CI, a fresh clone) gains nothing from incremental artifacts.
if [ "${CI:-}" = "true" ]; then export CARGO_INCREMENTAL=0; fi

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test"
# Build every target once (the tests, and the binaries the cluster step runs, with one feature
# set), then run the tests (--no-fail-fast: every failure is listed); tests bind 127.0.0.1 only
# and start etcd themselves.
cargo build --workspace --all-targets
cargo test --workspace --no-fail-fast

step "cluster --quick (network namespaces: etcd, router, 2 prefill + 2 decode mock nodes, faults)"
# Needs root for `ip netns` (CI runs as root). PDNODE_SKIP_CLUSTER_TESTS=1 skips it on purpose.
if [ "${PDNODE_SKIP_CLUSTER_TESTS:-}" = "1" ]; then
  echo "PDNODE_SKIP_CLUSTER_TESTS=1: skipping tests/cluster/run.sh --quick" >&2
else
  PDNODE_CLUSTER_BUILD_ALL=1 bash tests/cluster/run.sh --quick
fi

echo >&2
echo "==> all checks passed" >&2
