#!/usr/bin/env bash
# The cluster system tests: hosts as network namespaces on this machine (etcd, a router, two
# prefill and two decode nodes from configs/multi-host/), load at concurrency 64, one fault per
# case; one table row per case. Needs root (ip netns) and iproute2 + etcd (scripts/setup.sh).
#
#   tests/cluster/run.sh [--quick|--full] [--model PATH] [--case NAME] [--list] [--keep-logs]
#                        [--soak SECONDS]
#                        [--router-set KEY=VALUE]   (the soak's router, e.g. a small max_tree_size)
#                        [--pairing SECONDS]        (the pairing benchmark: one slow pair, TTFT
#                                                    under each prefill policy; a figure, no test)
#
# --quick (the default, CI): mock engines, about 4 minutes on 2 cores. --full: the same cases on
# the CPU engine with the demo model (or --model: another GGUF file or HF directory, e.g. the
# DeepSeek fixture crates/pdnode-engine/tests/fixtures/deepseek_v3), greedy, outputs compared
# across cases (not in CI).
# --soak SECONDS runs the soak instead of the cases (what tests/cluster/soak.sh calls). Exits 0
# only when every case passed.
#
# The driver (tests/cluster/src) builds and removes the namespaces itself; this script removes
# whatever is left under this run's prefix on any exit (the driver killed, Ctrl-C), killing the
# processes inside by PID first.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

args=()
soak=0
full=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick | --list | --keep-logs) args+=("$1") ;;
    --full) full=1; args+=("$1") ;;
    --case)
      [ $# -ge 2 ] || { echo "--case needs a name" >&2; exit 2; }
      args+=("$1" "$2"); shift ;;
    --model)
      [ $# -ge 2 ] || { echo "--model needs a path (GGUF file or HF directory)" >&2; exit 2; }
      args+=("$1" "$2"); shift ;;
    --soak)
      [ $# -ge 2 ] || { echo "--soak needs seconds" >&2; exit 2; }
      soak="$2"; args+=("$1" "$2"); shift ;;
    --pairing)
      [ $# -ge 2 ] || { echo "--pairing needs seconds" >&2; exit 2; }
      # Six clusters, each the window plus its start and warm-up.
      soak=$(( 6 * ($2 + 30) )); args+=("$1" "$2"); shift ;;
    --router-set)
      [ $# -ge 2 ] || { echo "--router-set needs KEY=VALUE" >&2; exit 2; }
      args+=("$1" "$2"); shift ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$(id -u)" -ne 0 ]; then
  echo "tests/cluster/run.sh needs root (it creates network namespaces)" >&2
  exit 2
fi
for b in ip etcd timeout; do
  command -v "$b" >/dev/null 2>&1 || { echo "missing $b: run scripts/setup.sh" >&2; exit 2; }
done
if ! command -v cargo >/dev/null 2>&1; then export PATH="$HOME/.cargo/bin:$PATH"; fi

echo "==> building pdnode and the cluster driver" >&2
# scripts/test.sh has built every target of the workspace (PDNODE_CLUSTER_BUILD_ALL=1): the same
# set again is a no-op, whereas these two binaries alone resolve other dependency features
# (tokio's dev-dependency ones) and would rebuild most of the tree (minutes of a cold CI build).
if [ "${PDNODE_CLUSTER_BUILD_ALL:-}" = "1" ]; then
  cargo build --quiet --workspace --all-targets
else
  cargo build --quiet -p pdnode --bin pdnode -p pdnode-cluster-tests --bin cluster-driver
fi
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

# Unique per run: namespaces are "$PREFIX-<host>".
PREFIX="pdc$$"
driver_pid=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # The driver first (timeout passes SIGTERM on): it stops its processes and namespaces.
  if [ -n "$driver_pid" ] && kill -0 "$driver_pid" 2>/dev/null; then
    kill -TERM "$driver_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$driver_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$driver_pid" 2>/dev/null || true
  fi
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || echo "could not delete namespace $ns" >&2
  done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Every step of the driver has its own deadline; this one bounds the whole run (a soak: its
# length and the same margin; --full: the CPU engine's cases take longer).
case "$soak" in '' | *[!0-9]*) echo "--soak / --pairing: whole seconds, not $soak" >&2; exit 2 ;; esac
bound=900
[ "$full" = 1 ] && bound=3600
timeout --kill-after=10 "$((soak + bound))" "$TARGET/cluster-driver" \
  --prefix "$PREFIX" --bin "$TARGET/pdnode" --repo "$ROOT" "${args[@]}" &
driver_pid=$!
wait "$driver_pid"
