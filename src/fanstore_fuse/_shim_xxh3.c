/* The shim's xxh3-64, dispatched at run time (the rules are in _shim_xxh3.h): the baseline
 * copy of xxhash.h, inline, built with the extension's flags; the AVX2 copy in
 * _shim_xxh3_avx2.c. The first call chooses (FANSTORE_XXH3, __builtin_cpu_supports) and
 * keeps the choice in a pointer; threads that race there choose the same. As xxHash's own
 * xxh_x86dispatch.c, the check must cover the OS as well as the CPU (AVX state saved by the
 * kernel, XCR0): libgcc's __builtin_cpu_supports only reports AVX2 when both allow it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "_shim_blobs.h"
#include "_shim_xxh3.h"

#if XXH_VECTOR == XXH_SSE2
#define BASE_NAME "sse2"
#elif XXH_VECTOR == XXH_AVX2
#define BASE_NAME "avx2-built" /* the whole build targets AVX2 (CFLAGS -mavx2) */
#elif XXH_VECTOR == XXH_AVX512
#define BASE_NAME "avx512-built"
#elif XXH_VECTOR == XXH_NEON
#define BASE_NAME "neon"
#elif XXH_VECTOR == XXH_VSX
#define BASE_NAME "vsx"
#else
#define BASE_NAME "scalar"
#endif

static uint64_t xxh3_base(const void *p, size_t n, uint64_t seed) {
    return XXH3_64bits_withSeed(p, n, seed);
}

static int always(void) { return 1; }

#ifdef FANSTORE_XXH3_AVX2
static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#endif

static const struct variant {
    const char *name;
    fanstore_xxh3_fn fn;
    int (*usable)(void);
} variants[] = {
    {BASE_NAME, xxh3_base, always}, /* first: the baseline; then slower to faster */
#ifdef FANSTORE_XXH3_AVX2
    {"avx2", fanstore_xxh3_avx2, has_avx2},
#endif
};
enum { NVARIANTS = sizeof variants / sizeof variants[0] };

static const struct variant *find(const char *name) {
    for (int k = 0; k < NVARIANTS; k++)
        if (strcmp(variants[k].name, name) == 0)
            return variants[k].usable() ? &variants[k] : NULL;
    return NULL;
}

static const struct variant *choose(void) {
    const char *want = getenv("FANSTORE_XXH3");
    if (want && *want && strcmp(want, "auto") != 0) {
        if (strcmp(want, "sse2") == 0 || strcmp(want, "baseline") == 0)
            return &variants[0];
        const struct variant *v = find(want);
        if (v)
            return v;
        fprintf(stderr, "fanstore: FANSTORE_XXH3=%s is not a variant this CPU runs (sse2, avx2, "
                        "auto); using auto\n", want);
    }
    for (int k = NVARIANTS - 1; k > 0; k--)
        if (variants[k].usable())
            return &variants[k];
    return &variants[0];
}

static const struct variant *chosen;

static const struct variant *current(void) {
    const struct variant *v = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (!v) {
        v = choose();
        __atomic_store_n(&chosen, v, __ATOMIC_RELEASE);
    }
    return v;
}

uint64_t fanstore_xxh3(const void *p, size_t n, uint64_t seed) { return current()->fn(p, n, seed); }

uint64_t fanstore_checksum(const void *p, size_t n) {
    return current()->fn(p, n, FANSTORE_HASH_SEED);
}

const char *fanstore_xxh3_impl(void) { return current()->name; }

/* ------------------------------------------------------------------ Python: tests, benches */

static int variant_arg(PyObject *name, fanstore_xxh3_fn *fn) {
    if (name == Py_None) {
        *fn = current()->fn;
        return 0;
    }
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    const struct variant *v = s ? find(s) : NULL;
    if (!v) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "not an xxh3 variant this CPU runs: %R", name);
        return -1;
    }
    *fn = v->fn;
    return 0;
}

PyObject *fanstore_py_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    unsigned long long seed;
    PyObject *name = Py_None;
    fanstore_xxh3_fn fn;
    if (!PyArg_ParseTuple(args, "y*K|O", &data, &seed, &name))
        return NULL;
    if (variant_arg(name, &fn) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS h = fn(data.buf, (size_t)data.len, seed);
    Py_END_ALLOW_THREADS PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

PyObject *fanstore_py_xxh3_impl(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(fanstore_xxh3_impl());
}

PyObject *fanstore_py_xxh3_variants(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *out = PyList_New(0);
    for (int k = 0; out && k < NVARIANTS; k++) {
        if (!variants[k].usable())
            continue;
        PyObject *s = PyUnicode_FromString(variants[k].name);
        if (!s || PyList_Append(out, s) < 0)
            Py_CLEAR(out);
        Py_XDECREF(s);
    }
    return out;
}

static long long thread_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

PyObject *fanstore_py_xxh3_cpu_ns(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *name;
    Py_buffer data;
    Py_ssize_t block, rounds;
    fanstore_xxh3_fn fn;
    if (!PyArg_ParseTuple(args, "Oy*nn", &name, &data, &block, &rounds))
        return NULL;
    if (block <= 0 || rounds < 0 || variant_arg(name, &fn) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "block must be > 0 and rounds >= 0");
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *p = data.buf;
    size_t len = (size_t)data.len, step = (size_t)block;
    volatile uint64_t sink = 0;
    long long t0;
    Py_BEGIN_ALLOW_THREADS t0 = thread_ns();
    for (Py_ssize_t r = 0; r < rounds; r++)
        for (size_t at = 0; at < len; at += step)
            sink ^= fn(p + at, len - at < step ? len - at : step, FANSTORE_HASH_SEED);
    t0 = thread_ns() - t0;
    Py_END_ALLOW_THREADS PyBuffer_Release(&data);
    (void)sink;
    return PyLong_FromLongLong(t0);
}
