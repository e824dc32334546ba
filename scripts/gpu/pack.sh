#!/usr/bin/env bash
# Packs what scripts/gpu/{transfer,serve}.sh need on the H200 host into one xz tarball under the
# 64 MiB the device tool carries: the stripped pdnode, etcd (Debian's static binary, for the PD
# registry) and the shared libraries + ucx_info/ucx_perftest of the libucx-cu13 1.22 wheel.
# Run on a build host after `cargo build --release -p pdnode`; carry `.gpu-pd` (in .git/info/exclude).
# PERFTEST=0 leaves ucx_perftest out; TESTS_DIR=.gpu adds the GPU test binaries as t/
# (TESTS_ONLY=1: nothing else).
# On the GPU host: `mkdir -p /tmp/pd && tar -xJf .gpu-pd/bundle.tar.xz -C /tmp/pd`.
set -euo pipefail
cd "$(dirname "$0")/../.."
# TESTS_ONLY=1: only the GPU test binaries of scripts/gpu/build.sh (TESTS_DIR, default .gpu) as
# t/, for sessions that run tests and benches but no node (session.sh tests, variants, decode).
if [ "${TESTS_ONLY:-0}" = 1 ]; then
    mkdir -p .gpu-pd
    tar -C "$(dirname "${TESTS_DIR:-.gpu}")" --transform "s,^$(basename "${TESTS_DIR:-.gpu}"),t," \
        -cf - "$(basename "${TESTS_DIR:-.gpu}")" | xz -9 -T2 > .gpu-pd/bundle.tar.xz
    ls -la .gpu-pd/bundle.tar.xz
    exit 0
fi
WHL_DIR=${WHL_DIR:-/tmp/whl}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
[ -e "$WHL_DIR"/libucx_cu13-1.22.0-*.whl ] 2>/dev/null || ls "$WHL_DIR"/libucx_cu13-1.22.0-*.whl >/dev/null ||
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$WHL_DIR" libucx-cu13==1.22.0
python3 -m zipfile -e "$(ls "$WHL_DIR"/libucx_cu13-1.22.0-*.whl | head -1)" "$stage/w"
u=$stage/ucx/libucx
mkdir -p "$u/lib/ucx" "$u/bin"
for d in lib lib/ucx; do
    for f in "$stage/w/libucx/$d"/*.so.0.0.0; do
        b=$(basename "$f" .so.0.0.0)
        cp "$f" "$u/$d/"
        ln -s "$b.so.0.0.0" "$u/$d/$b.so.0"
        ln -s "$b.so.0.0.0" "$u/$d/$b.so"
    done
done
cp "$stage/w/libucx/bin/ucx_info" "$stage/w/libucx/bin/ucx_perftest" "$u/bin/"
# libucm_cuda needs the wheel's libcudart, ucx_perftest its libgomp ($ORIGIN/../../libucx_cu13.libs).
cp -r "$stage/w/libucx_cu13.libs" "$stage/ucx/"
chmod +x "$u/bin"/*
if [ "${PERFTEST:-1}" = 0 ]; then # the ceiling tools stay behind (saves ~4 MB of the carry)
    rm -f "$u/bin/ucx_perftest" "$u/lib/ucx"/libucx_perftest_cuda.so* "$stage"/ucx/libucx_cu13.libs/libgomp*
fi
cp target/release/pdnode "$stage/pdnode" && strip "$stage/pdnode"
extra=()
if [ -n "${TESTS_DIR:-}" ]; then # the GPU test binaries of scripts/gpu/build.sh, as t/
    cp -r "$TESTS_DIR" "$stage/t" && extra+=(t)
fi
cp /usr/bin/etcd "$stage/etcd"
mkdir -p .gpu-pd
tar -C "$stage" -cf - pdnode etcd ucx "${extra[@]}" | xz -9 -T2 > .gpu-pd/bundle.tar.xz
ls -la .gpu-pd/bundle.tar.xz
