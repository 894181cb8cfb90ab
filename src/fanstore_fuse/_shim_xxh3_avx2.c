/* xxh3-64 built for AVX2 (see _shim_xxh3.h): this file alone is compiled for AVX2, through
 * GCC's target pragma, with its own inline copy of xxhash.h (XXH_INLINE_ALL: every xxhash
 * function static here, no clash with the baseline copy in _shim_xxh3.c). Nothing in this
 * file may run unless __builtin_cpu_supports("avx2") said yes (_shim_xxh3.c's choice). */
#include "_shim_xxh3.h"

#ifdef FANSTORE_XXH3_AVX2
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

uint64_t fanstore_xxh3_avx2(const void *p, size_t n, uint64_t seed) {
    return XXH3_64bits_withSeed(p, n, seed);
}
#else
typedef int fanstore_xxh3_avx2_unused; /* not x86-64 with GCC: nothing here (ISO C: no empty file) */
#endif
