#!/bin/sh
# Prints the sizes and offsets of the UCP structs ucx-sys declares by hand, as the C compiler sees
# them in the installed headers. `tests/layout.rs` compares the Rust declarations with
# layout/expected-<version>.txt, written by this script:
#   crates/ucx-sys/layout/check.sh [INCLUDE_DIR] > crates/ucx-sys/layout/expected-1.13.txt
# (needs gcc and libucx-dev, or `-I<wheel>/libucx/include` for the PyPI wheel's headers).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
inc=${1:-/usr/include}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
gcc -I"$inc" "$here/check.c" -o "$tmp/check"
"$tmp/check"
