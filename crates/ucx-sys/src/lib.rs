//! ucx-sys: Run-time loaded bindings for the UCP subset pdnode uses (libloading; no UCX needed to build).
