// KV hand-off: copy layer-blocks between the pool and a staging buffer ordered [layer][block].
// A layer-block (K then V of one layer of one block) is lb_vec 16-byte words; layer l of the
// launch starts stride_vec words after layer l - 1 (nblocks * lb_vec when the launch's blocks
// are all of a span's; more when a prefill fills its span chunk by chunk: one launch a chunk).
// grid: nlayers * nblocks, block: 256.

extern "C" __global__ void kv_gather(const uint4* __restrict__ pool, uint4* __restrict__ staging,
                                     const int* __restrict__ blocks, int nblocks, int layer0,
                                     int num_blocks, i64 lb_vec, i64 stride_vec) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 idx = blockIdx.x;
    const i64 l = idx / nblocks, b = idx % nblocks;
    const uint4* src = pool + ((i64)(layer0 + l) * num_blocks + blocks[b]) * lb_vec;
    uint4* dst = staging + l * stride_vec + b * lb_vec;
    for (i64 i = threadIdx.x; i < lb_vec; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void kv_scatter(uint4* __restrict__ pool, const uint4* __restrict__ staging,
                                      const int* __restrict__ blocks, int nblocks, int layer0,
                                      int num_blocks, i64 lb_vec, i64 stride_vec) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 idx = blockIdx.x;
    const i64 l = idx / nblocks, b = idx % nblocks;
    uint4* dst = pool + ((i64)(layer0 + l) * num_blocks + blocks[b]) * lb_vec;
    const uint4* src = staging + l * stride_vec + b * lb_vec;
    for (i64 i = threadIdx.x; i < lb_vec; i += blockDim.x) dst[i] = src[i];
}
