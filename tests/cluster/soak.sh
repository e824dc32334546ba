#!/usr/bin/env bash
# The soak (issue 18; not in CI): the cluster of tests/cluster/run.sh (etcd, a router, two
# prefill and two decode mock nodes, each host a network namespace, mTLS, KV over UCX tcp)
# under closed-loop load at concurrency 64 for a long time, no fault. Samples every process's
# resident memory and open descriptors; fails on any failed or hung request, anything held
# afterwards, or a process that grew 5 % or more from the end of the warm-up (a tenth of the
# run) to the end. Needs root (ip netns).
#
#   tests/cluster/soak.sh [--minutes N] [--keep-logs] [--router-set KEY=VALUE ...]   # N: 30 by default
#   (--router-set: a --set for the router, e.g. router.cache_aware.max_tree_size=20000)
set -euo pipefail

minutes=30
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes)
      [ $# -ge 2 ] || { echo "--minutes needs a number" >&2; exit 2; }
      minutes="$2"; shift ;;
    --keep-logs) args+=("$1") ;;
    --router-set)
      [ $# -ge 2 ] || { echo "--router-set needs KEY=VALUE" >&2; exit 2; }
      args+=("$1" "$2"); shift ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$minutes" in
  '' | *[!0-9]*) echo "--minutes: a whole number of minutes, not $minutes" >&2; exit 2 ;;
esac

exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" --soak "$((minutes * 60))" "${args[@]}"
