/* What the C files of the digest library share (setup.py builds them into one library). */
#ifndef SAMEBITS_NATIVE_H
#define SAMEBITS_NATIVE_H

#if defined(_WIN32)
#define SAMEBITS_EXPORT __declspec(dllexport)
#else
#define SAMEBITS_EXPORT __attribute__((visibility("default")))
#endif

/* x86-64 with GCC >= 9 or clang: per-function target attributes and __builtin_cpu_supports. */
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9)
#define SAMEBITS_X86 1
#include <immintrin.h>
#else
#define SAMEBITS_X86 0
#endif

#endif
