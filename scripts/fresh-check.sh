#!/usr/bin/env bash
# Proves the README's two commands on a clean Debian 12 root, as a new user on a fresh machine of
# the project's kind would run them: what CI cannot see, since CI runs on a machine where earlier
# sessions installed things by hand.
#
#   scripts/fresh-check.sh [--no-test] [--keep] [--new-base]
#
# 1. A minimal Debian 12 root (debootstrap --variant=minbase), built once under
#    .cache/fresh-check/base-<hash> and reused while its recipe (suite, variant, mirror, this
#    script's BASE_RECIPE) is unchanged. Each run works in a fresh copy of it, so the base stays clean.
# 2. A clean clone of this checkout's HEAD (uncommitted changes are not checked: a warning says so).
# 3. The host's Rust toolchain, bind-mounted read-only (the toolchain is not what is checked; the
#    system packages are), and the host's crate download cache (crates, not system packages).
#    The apt and pip client settings of this machine are copied in: a fresh machine of this kind
#    has them, and its local certificate authorities.
# 4. Inside (unshare: own mount and PID namespaces, so every process it starts dies with it):
#    setup    scripts/setup.sh
#    run      the README's first command, until the README's curl example is answered with Paris
#    test     the README's second command
#    Each step's log is in .cache/fresh-check/logs/<step>.log; a failed step prints its log's tail.
#
# --no-test stops after the run step (for iterating on install steps); --keep keeps the work root;
# --new-base rebuilds the base root. Needs root (debootstrap, chroot, mounts) and ~15 GB of disk.
# Too slow for CI (~45 min on 2 cores): run it before resolving any issue that changes
# dependencies or install steps.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache/fresh-check"
SUITE=bookworm
VARIANT=minbase
# Bump when the base root's recipe changes in a way the hash below cannot see.
BASE_RECIPE=1
RUN_DEADLINE_S=${FRESH_RUN_DEADLINE_S:-3600}

do_test=1
keep=0
new_base=0
for a in "$@"; do
  case "$a" in
    --no-test) do_test=0 ;;
    --keep) keep=1 ;;
    --new-base) new_base=1 ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "fresh-check: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "[fresh-check] $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot, bind mounts)"
for tool in unshare chroot git; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found"
done
if ! command -v debootstrap >/dev/null 2>&1; then
  log "installing debootstrap (Debian's package)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null ||
    { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null; }
fi

# The Debian mirror this machine's apt uses (deb822 or one-line sources), else Debian's default.
mirror="$(
  { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
    grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
  } | grep -v security | head -n1
)" || true
mirror="${mirror:-http://deb.debian.org/debian}"

# --- the README's commands --------------------------------------------------------------------
readme="$REPO/README.md"
mapfile -t quick < <(awk '/^## Quickstart/{q=1} q && /^```sh/{b=1; next} b && /^```/{exit} b' "$readme" |
  sed 's/[[:space:]]*#.*$//' | grep -v '^[[:space:]]*$')
[ "${#quick[@]}" -ge 2 ] || die "README.md's Quickstart block has fewer than two commands"
run_cmd="${quick[0]}"
test_cmd="${quick[1]}"
# The curl example: from its first line to the line before the comment that shows its answer.
curl_cmd="$(awk '/^curl -s http:\/\/127.0.0.1:8000\/v1\/chat\/completions/{c=1} c && /^#/{exit} c' "$readme")"
[ -n "$curl_cmd" ] || die "README.md has no curl example for /v1/chat/completions"
log "run command:  $run_cmd"
log "test command: $test_cmd"

# The root, a release build and the test build take ~15 GB; a full disk fails the build steps
# in ways that look like the project's fault.
free_gb=$(( $(df -Pk "$REPO" | awk 'NR==2 {print $4}') / 1048576 ))
[ "$free_gb" -ge 20 ] || die "only ${free_gb} GB free under $REPO: needs 20 GB"

# --- base root --------------------------------------------------------------------------------
hash="$(printf '%s\n' "$SUITE" "$VARIANT" "$mirror" "$BASE_RECIPE" | sha256sum | cut -c1-12)"
base="$CACHE/base-$hash"
if [ "$new_base" = 1 ]; then rm -rf "$base"; fi
if [ ! -f "$base/.complete" ]; then
  log "building the base root $base (debootstrap $VARIANT $SUITE from $mirror)"
  rm -rf "$base.tmp"
  mkdir -p "$CACHE"
  debootstrap --variant="$VARIANT" "$SUITE" "$base.tmp" "$mirror" >"$CACHE/debootstrap.log" 2>&1 ||
    { tail -n 30 "$CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
  touch "$base.tmp/.complete"
  # Older bases of another recipe are not reused.
  find "$CACHE" -maxdepth 1 -name 'base-*' ! -name "base-$hash*" -exec rm -rf {} +
  mv "$base.tmp" "$base"
else
  log "reusing the base root $base"
fi

# --- this run's root ----------------------------------------------------------------------------
work="$CACHE/root"
logs="$CACHE/logs"
rm -rf "$work" "$logs"
mkdir -p "$logs"
cp -a "$base" "$work"
rm -f "$work/.complete"

# apt and pip as set up on this machine (a fresh machine of this kind has the same settings).
cp -a /etc/apt/sources.list.d/. "$work/etc/apt/sources.list.d/" 2>/dev/null || true
[ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$work/etc/apt/sources.list"
for f in /etc/apt/apt.conf.d/*; do
  [ -e "$work/etc/apt/apt.conf.d/$(basename "$f")" ] || cp "$f" "$work/etc/apt/apt.conf.d/"
done
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$work/etc/pip.conf"
# Local certificate authorities of this machine (e.g. an egress proxy's): ca-certificates, which
# setup.sh installs, adds them to the system bundle that pip and cargo use.
if [ -d /usr/local/share/ca-certificates ]; then
  mkdir -p "$work/usr/local/share/ca-certificates"
  cp -a /usr/local/share/ca-certificates/. "$work/usr/local/share/ca-certificates/"
fi
cp -L /etc/resolv.conf "$work/etc/resolv.conf"
# Services do not start inside a chroot (as in Debian's container images): etcd-server's package
# would otherwise start a system etcd on the host's port 2379.
printf '#!/bin/sh\nexit 101\n' >"$work/usr/sbin/policy-rc.d"
chmod +x "$work/usr/sbin/policy-rc.d"

if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
  log "WARNING: uncommitted changes in $REPO are not checked (the clone is of HEAD)"
fi
git clone -q --no-hardlinks "$REPO" "$work/src/pdnode"
commit="$(git -C "$work/src/pdnode" rev-parse --short HEAD)"
log "checking commit $commit"

rustup_home="${RUSTUP_HOME:-$HOME/.rustup}"
cargo_home="${CARGO_HOME:-$HOME/.cargo}"
[ -x "$cargo_home/bin/cargo" ] || die "no Rust toolchain on the host ($cargo_home/bin/cargo)"
mkdir -p "$work/opt/rustup" "$work/opt/cargo/bin" "$work/root/.cargo/registry" "$cargo_home/registry"

# --- the steps, inside the root -------------------------------------------------------------------
# The README's commands, each in its own file: they are run as written there.
printf '%s\n' "$run_cmd" >"$work/fresh-run.sh"
printf '%s\n' "$curl_cmd" >"$work/fresh-curl.sh"
printf '%s\n' "$test_cmd" >"$work/fresh-test.sh"
cat >"$work/fresh-steps.sh" <<EOF
#!/bin/bash
# Runs inside the chroot with a clean environment. Writes one line per step to /fresh-results:
# name rc seconds.
export HOME=/root RUSTUP_HOME=/opt/rustup CARGO_HOME=/root/.cargo TERM=dumb
export PATH=/opt/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export LANG=C.UTF-8
cd /src/pdnode
: >/fresh-results
step() {
  local name=\$1; shift
  local t0=\$(date +%s)
  "\$@" >"/fresh-logs/\$name.log" 2>&1
  local rc=\$?
  echo "\$name \$rc \$(( \$(date +%s) - t0 ))" >>/fresh-results
  return \$rc
}
serve_and_ask() {
  setsid bash /fresh-run.sh >/fresh-logs/run-server.log 2>&1 &
  local pid=\$! deadline=\$(( \$(date +%s) + $RUN_DEADLINE_S ))
  local rc=1 answer
  while [ \$(date +%s) -lt \$deadline ]; do
    if ! kill -0 \$pid 2>/dev/null; then echo "the run command exited"; tail -n 40 /fresh-logs/run-server.log; break; fi
    if answer=\$(bash /fresh-curl.sh 2>/dev/null) && [ -n "\$answer" ]; then
      echo "answer: \$answer"
      if echo "\$answer" | grep -q Paris; then rc=0; else echo "no 'Paris' in the answer"; fi
      break
    fi
    sleep 5
  done
  kill -TERM -- -\$pid 2>/dev/null; sleep 2; kill -KILL -- -\$pid 2>/dev/null
  tail -n 5 /fresh-logs/run-server.log
  return \$rc
}
step setup bash scripts/setup.sh || exit 1
step run serve_and_ask || exit 1
if [ "$do_test" = 1 ]; then step test bash /fresh-test.sh || exit 1; fi
exit 0
EOF
chmod +x "$work/fresh-steps.sh"
mkdir -p "$work/fresh-logs"

log "running setup, run$([ "$do_test" = 1 ] && echo ', test') inside the root (logs: $logs)"
set +e
unshare --mount --pid --fork --propagation private bash -c '
  set -e
  w=$1
  # The root is a mount point, as on a real machine: `ip netns` (tests/cluster) remounts / as
  # a slave and fails with EINVAL on a plain directory.
  mount --bind "$w" "$w"
  mount -t proc proc "$w/proc"
  mount --rbind /sys "$w/sys"
  mount --rbind /dev "$w/dev"
  mount -t tmpfs -o size=4g tmpfs "$w/dev/shm"
  mount --bind "$2" "$w/opt/rustup"; mount -o remount,bind,ro "$w/opt/rustup"
  mount --bind "$3/bin" "$w/opt/cargo/bin"; mount -o remount,bind,ro "$w/opt/cargo/bin"
  mount --bind "$3/registry" "$w/root/.cargo/registry"
  exec env -i "$4" "$w" /fresh-steps.sh
' _ "$work" "$rustup_home" "$cargo_home" "$(command -v chroot)"
rc=$?
set -e
cp -a "$work/fresh-logs/." "$logs/" 2>/dev/null || true

# --- report -------------------------------------------------------------------------------------
echo
printf '%-8s %-6s %8s\n' step result seconds
failed=""
for name in setup run test; do
  line="$(grep "^$name " "$work/fresh-results" 2>/dev/null || true)"
  if [ -z "$line" ]; then
    if [ "$name" = test ] && [ "$do_test" = 0 ]; then printf '%-8s %-6s %8s\n' "$name" skipped -; else printf '%-8s %-6s %8s\n' "$name" "not-run" -; fi
    continue
  fi
  read -r _ src secs <<<"$line"
  if [ "$src" = 0 ]; then printf '%-8s %-6s %8s\n' "$name" ok "$secs"; else printf '%-8s %-6s %8s\n' "$name" FAIL "$secs"; failed="${failed:-$name}"; fi
done
if [ -n "$failed" ] || [ "$rc" != 0 ]; then
  step="${failed:-setup}"
  echo
  log "step '$step' failed (commit $commit); last lines of $logs/$step.log:"
  tail -n 40 "$logs/$step.log" >&2 2>/dev/null || true
  [ "$keep" = 1 ] || rm -rf "$work"
  exit 1
fi
grep -h '^answer:' "$logs/run.log" | cut -c1-300 || true
log "PASS: commit $commit, the README's commands work on a clean Debian 12 root"
[ "$keep" = 1 ] || rm -rf "$work"
