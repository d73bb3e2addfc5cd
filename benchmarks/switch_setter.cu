#include <cuda_runtime.h>
struct Handles { cudaGraphConditionalHandle h[32]; };
// Place r's switch: the expert routed there where it missed (``miss`` null: every place),
// else ``none`` (no body runs). One thread a place.
extern "C" __global__ void set_switches(Handles hs, const long long* routed,
                                        const unsigned char* miss, int k, unsigned int none) {
    int r = threadIdx.x;
    if (r < k) {
        unsigned int v = none;
        if (miss == nullptr || miss[r]) {
            long long e = routed[r];
            v = (e >= 0 && e < (long long)none) ? (unsigned int)e : none;
        }
        cudaGraphSetConditional(hs.h[r], v);
    }
}
