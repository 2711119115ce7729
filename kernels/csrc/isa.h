/* The ISA level this translation unit is compiled for (kernels/isa.py passes the flags); each
 * extension includes this once and exports kvpilot_isa() so a test can check what it loaded. */
#ifndef KVPILOT_ISA_H
#define KVPILOT_ISA_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVPILOT_ISA_AVX512 1
#define KVPILOT_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVPILOT_ISA_AVX2 1
#define KVPILOT_ISA "avx2"
#else
#define KVPILOT_ISA "generic"
#endif

const char *kvpilot_isa(void) { return KVPILOT_ISA; }

#endif
