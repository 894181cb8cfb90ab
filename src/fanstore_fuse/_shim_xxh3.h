/* xxh3-64, the format's checksum (_format.checksum: seed FANSTORE_HASH_SEED), in the fastest
 * variant this CPU runs, chosen once at run time (_shim_xxh3.c). The build targets the
 * baseline of its architecture (x86-64: SSE2), so that copy runs anywhere; on x86-64 with GCC
 * a second copy, built for AVX2 (_shim_xxh3_avx2.c), is used where __builtin_cpu_supports
 * says the CPU and the OS allow it. xxh3 gives the same value in every variant: only the speed
 * differs. FANSTORE_XXH3=sse2 (or baseline) forces the baseline copy, =avx2 AVX2 where the CPU
 * has it; unset or auto: the fastest here. Every hash the shim computes goes through
 * fanstore_xxh3 (fanstore_checksum, _shim_blobs.h, with the format's seed). Thread-safe, no
 * GIL. */
#ifndef FANSTORE_SHIM_XXH3_H
#define FANSTORE_SHIM_XXH3_H
#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*fanstore_xxh3_fn)(const void *p, size_t n, uint64_t seed);

uint64_t fanstore_xxh3(const void *p, size_t n, uint64_t seed); /* the chosen variant */
const char *fanstore_xxh3_impl(void);                           /* its name: "sse2", "avx2" */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FANSTORE_XXH3_AVX2 1
/* _shim_xxh3_avx2.c: built for AVX2; call only where __builtin_cpu_supports("avx2"). */
uint64_t fanstore_xxh3_avx2(const void *p, size_t n, uint64_t seed);
#endif

#ifdef Py_PYTHON_H /* the module's functions, for _noflush.c's method table */
PyObject *fanstore_py_xxh3(PyObject *self, PyObject *args);
PyObject *fanstore_py_xxh3_impl(PyObject *self, PyObject *unused);
PyObject *fanstore_py_xxh3_variants(PyObject *self, PyObject *unused);
PyObject *fanstore_py_xxh3_cpu_ns(PyObject *self, PyObject *args);

#define FANSTORE_XXH3_METHODS                                                                    \
    {"xxh3", fanstore_py_xxh3, METH_VARARGS,                                                     \
     "xxh3(data, seed, variant=None): xxh3-64 of a buffer by the shim (variant: one of "         \
     "xxh3_variants(); None: the chosen one)"},                                                  \
    {"xxh3_impl", fanstore_py_xxh3_impl, METH_NOARGS,                                            \
     "xxh3_impl(): the xxh3 variant the shim's checksums use (FANSTORE_XXH3 forces one)"},      \
    {"xxh3_variants", fanstore_py_xxh3_variants, METH_NOARGS,                                    \
     "xxh3_variants(): the variants this CPU runs, the baseline first"},                         \
    {"xxh3_cpu_ns", fanstore_py_xxh3_cpu_ns, METH_VARARGS,                                       \
     "xxh3_cpu_ns(variant, data, block, rounds): thread CPU ns to hash data in block-sized "    \
     "calls, rounds times (the GIL released; for benches)"},
#endif

#endif
