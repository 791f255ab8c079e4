// The paged KV cache as the kernels address it (shared/kv_sizing.py, docs/ARCHITECTURE.md "KV
// memory"). A page holds KV_PAGE consecutive positions of one sequence in every layer; pages live
// in chunks of `cp` pages, chunk c's keys (values) an f16 array [n_layers, cp, n_kv, KV_PAGE, hd]
// at kchunks[c] (vchunks[c]). A sequence owns one row r of the page table: page_table[r *
// max_pages + i] is the page of its positions [KV_PAGE * i, KV_PAGE * (i + 1)), -1 where it has
// none. A key tile of the attention kernel (32 keys) is exactly one page. The tables are device
// memory written between passes (in-stream memory: read with coherent loads, common.cuh's rule),
// so a captured graph replays over a grown pool and new page tables unchanged.
#pragma once

#define KV_PAGE 32

// The page of position p of row `row` (-1: none).
__device__ __forceinline__ int kv_page_of(const int* page_table, int row, int max_pages, int p) {
    return __ldca(page_table + (long long)row * max_pages + p / KV_PAGE);
}

// Where (layer, page, kv-head g)'s KV_PAGE x hd rows start in the chunk table `chunks` (keys or
// values): the chunk's address plus the rows before them.
__device__ __forceinline__ u16* kv_page_rows(const unsigned long long* chunks, int page, int layer, int g,
                                            int cp, int n_kv, int hd) {
    const int c = page / cp, local = page - c * cp;
    u16* base = (u16*)__ldca(chunks + c);
    return base + (((long long)layer * cp + local) * n_kv + g) * KV_PAGE * hd;
}
