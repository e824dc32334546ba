#!/usr/bin/env bash
# The main job: an all-in-one pdnode (router + prefill + decode in one process) on the CPU with
# the demo model, serving the OpenAI API on http://127.0.0.1:8000. Extra arguments go to
# `pdnode start` (e.g. --set router.http_listen=0.0.0.0:8000).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
if ! command -v cargo >/dev/null 2>&1; then export PATH="$HOME/.cargo/bin:$PATH"; fi
bash scripts/fetch-model.sh

exec cargo run --release --bin pdnode -- start --config configs/local.toml "$@"
