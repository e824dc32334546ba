#!/usr/bin/env bash
# Installs what pdnode needs to build and test on Debian 12 (bookworm): system packages with
# apt-get (each package says why below) and a Rust toolchain when cargo is missing.
# Idempotent: installs only what is missing. Runs as root, or with sudo when it is available.
set -euo pipefail

PACKAGES=(
  build-essential       # cc and the linker: cargo links every crate; some -sys dependencies compile C
  ca-certificates curl  # rustup (when cargo is missing) and pip over https
  git                   # cargo's git index, scripts/fresh-check.sh's clean clone
  protobuf-compiler     # protoc: etcd-client's build compiles etcd's .proto files with it
  libprotobuf-dev       # google/protobuf/*.proto: Debian's protoc ships without the well-known types
  etcd-server           # etcd: the registry tests and the multi-process tests start their own
  libucx0               # libucp.so.0: ucx-sys loads it at run time for the KV hand-off between processes
  ucx-utils             # ucx_info: which transports UCX sees (docs/troubleshooting, scripts/gpu)
  libucx-dev            # UCX headers: crates/ucx-sys/layout/check.sh re-derives the struct layouts
  iproute2              # ip netns / veth / bridge: tests/cluster/run.sh builds its hosts as network namespaces
  python3 python3-pip   # fetch-model.sh / fetch-nvrtc.sh unpack PyPI wheels; the openai client tests
)
RUST_TOOLCHAIN="${PDNODE_RUST_TOOLCHAIN:-1.95.0}"

log() { echo "[setup] $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    log "need root for: $*  (run as root or install sudo)"
    return 1
  fi
}

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# python3-pip is not needed when pip is already there some other way (pyenv, venv).
if printf '%s\n' "${missing[@]}" | grep -qx python3-pip && python3 -m pip --version >/dev/null 2>&1; then
  missing=("${missing[@]/python3-pip}")
fi
packages=()
for p in "${missing[@]}"; do [ -n "$p" ] && packages+=("$p"); done

if [ "${#packages[@]}" -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    log "apt-get not found; install these yourself: ${packages[*]}"
    exit 1
  fi
  log "installing: ${packages[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${packages[@]}"
else
  log "system packages present"
fi

# etcd-server's package starts a system etcd on 2379; tests start their own on free ports, so the
# system one is left alone.

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  log "cargo not found: installing Rust $RUST_TOOLCHAIN with rustup"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
    sh -s -- -y --profile minimal --default-toolchain "$RUST_TOOLCHAIN" -c rustfmt -c clippy
  export PATH="$HOME/.cargo/bin:$PATH"
else
  log "cargo present: $(cargo --version)"
fi
# rustfmt and clippy are part of the test command.
if command -v rustup >/dev/null 2>&1; then
  for c in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$c"; then
      log "adding rustup component $c"
      rustup component add "$c"
    fi
  done
fi

# The official openai Python client: the end-to-end tests drive the router with it.
if ! python3 -c "import openai" >/dev/null 2>&1; then
  log "installing the openai Python client (pip)"
  python3 -m pip install --quiet openai || python3 -m pip install --quiet --break-system-packages openai
else
  log "openai Python client present"
fi
