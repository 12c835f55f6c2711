// A CUDA runtime call checked, for the standalone benches: on failure, the file, line, call
// and CUDA's message, then exit.
#pragma once
#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                               \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)
