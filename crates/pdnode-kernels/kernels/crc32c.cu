// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) of a device byte range, the same value as
// pdnode-transfer's checksum.rs: the integrity check of a KV hand-off that never leaves the GPU.
//
// The range of `len` bytes is cut into `nchunks` chunks counted from its end: chunk j (j = 0 the
// last) is the `chunk` bytes ending `j * chunk` bytes before the end, and the first chunk (j =
// nchunks - 1) takes what is left (1 .. chunk bytes). Thread j sums its chunk into the bare CRC
// register (started from 0, no final inversion: a linear function of the bytes) with
// slicing-by-8 tables in shared memory, then shifts it over the `j * chunk` bytes that follow it
// with the zero-append operators ops[k] = Z(chunk * 2^k) (32 columns each, built on the host:
// pdnode-cuda's ops/crc32c.rs) for the set bits of j. The XOR of the shifted values is the bare
// CRC of the whole range (crc(A || B) = Z(|B|) crc(A) ^ crc(B) for the bare register); each warp
// XORs its lanes' values into *out (zeroed by the caller). The host turns it into the standard
// CRC32C: bare ^ Z(len)(0xFFFFFFFF) ^ 0xFFFFFFFF.
// grid: ceil(nchunks / 256), block: 256 (each thread builds one entry of each table).

#define CRC32C_POLY 0x82F63B78u

// v * M over GF(2): the XOR of the columns of M selected by the set bits of v.
__device__ __forceinline__ unsigned crc32c_gf2_times(const unsigned* __restrict__ m, unsigned v) {
    unsigned sum = 0;
#pragma unroll
    for (int i = 0; i < 32; i++) sum ^= (v >> i & 1u) ? m[i] : 0u;
    return sum;
}

extern "C" __global__ void __launch_bounds__(256) crc32c_chunks(
    const unsigned char* __restrict__ data, unsigned long long len, unsigned long long chunk,
    unsigned long long nchunks, const unsigned* __restrict__ ops, int nops,
    unsigned* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned tab[8][256];
    __shared__ unsigned sops[64 * 32];
    {
        const unsigned i = threadIdx.x;
        unsigned c = i;
#pragma unroll
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        tab[0][i] = c;
    }
    for (int i = threadIdx.x; i < nops * 32; i += blockDim.x) sops[i] = ops[i];
    __syncthreads();
    {
        const unsigned i = threadIdx.x;
        unsigned c = tab[0][i];
#pragma unroll
        for (int s = 1; s < 8; s++) {
            c = (c >> 8) ^ tab[0][c & 0xffu];
            tab[s][i] = c;
        }
    }
    __syncthreads();
    const unsigned long long j = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned v = 0;
    if (j < nchunks) {
        // [begin, end) of chunk j, counted from the end of the range
        const unsigned long long end = len - j * chunk;
        const unsigned long long begin = j + 1 == nchunks ? 0 : end - chunk;
        const unsigned char* p = data + begin;
        const unsigned char* e = data + end;
        unsigned c = 0;
        // bytes up to an 8-byte boundary, whole words, then the tail
        while (p < e && ((unsigned long long)p & 7u)) c = (c >> 8) ^ tab[0][(c ^ *p++) & 0xffu];
        for (; p + 8 <= e; p += 8) {
            const unsigned long long w = *(const unsigned long long*)p;
            const unsigned lo = c ^ (unsigned)w, hi = (unsigned)(w >> 32);
            c = tab[7][lo & 0xffu] ^ tab[6][(lo >> 8) & 0xffu] ^ tab[5][(lo >> 16) & 0xffu] ^
                tab[4][lo >> 24] ^ tab[3][hi & 0xffu] ^ tab[2][(hi >> 8) & 0xffu] ^
                tab[1][(hi >> 16) & 0xffu] ^ tab[0][hi >> 24];
        }
        while (p < e) c = (c >> 8) ^ tab[0][(c ^ *p++) & 0xffu];
        // shift over the j * chunk bytes after this chunk
        for (int k = 0; k < nops; k++)
            if (j >> k & 1ull) c = crc32c_gf2_times(sops + 32 * k, c);
        v = c;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0 && v) atomicXor(out, v);
}
