// Copies chosen on the device, made by the copy engine: per routed place a SWITCH conditional
// node whose body e copies expert e's members from pinned host memory into the place's stage
// slot (probe for torchoffload, issue 41).
#include <cuda_runtime.h>
#include <vector>

#include "switch_setter.cu"  // Handles, set_switches

#define MAXK ((int)(sizeof(Handles) / sizeof(cudaGraphConditionalHandle)))

static int err(cudaError_t e, int where) { return e == cudaSuccess ? 0 : (where * 1000 + (int)e); }
#define CHECK(x, w) do { int _r = err((x), (w)); if (_r) return _r; } while (0)

// While `stream` captures: one kernel reading routed[k] (and miss[k], or none: every place)
// and k SWITCH nodes after it, each of `experts` bodies; body e of place r copies, for each
// member m, bytes[m] from src[e * members + m] (pinned host) to dst[r * members + m] (device).
// The stream's capture continues after every switch. Returns 0, or where * 1000 + the error.
extern "C" int add_routed_copies(cudaStream_t stream, int k, int experts, int members,
                                 const unsigned long long* src, const unsigned long long* dst,
                                 const unsigned long long* bytes, const long long* routed,
                                 const unsigned char* miss, int chain) {
    if (k > MAXK) return -2;
    cudaStreamCaptureStatus st;
    unsigned long long id;
    cudaGraph_t graph;
    const cudaGraphNode_t* deps;
    const cudaGraphEdgeData* ed;
    size_t ndeps;
    CHECK(cudaStreamGetCaptureInfo(stream, &st, &id, &graph, &deps, &ed, &ndeps), 1);
    if (st != cudaStreamCaptureStatusActive) return -1;
    Handles hs;
    for (int r = 0; r < k; ++r)
        CHECK(cudaGraphConditionalHandleCreate(&hs.h[r], graph, (unsigned int)experts,
                                               cudaGraphCondAssignDefault), 2);
    set_switches<<<1, 32, 0, stream>>>(hs, routed, miss, k, (unsigned int)experts);
    CHECK(cudaGetLastError(), 3);
    CHECK(cudaStreamGetCaptureInfo(stream, &st, &id, &graph, &deps, &ed, &ndeps), 4);
    std::vector<cudaGraphNode_t> after(deps, deps + ndeps);  // the set kernel
    std::vector<cudaGraphNode_t> ends;
    for (int r = 0; r < k; ++r) {
        cudaGraphNodeParams p = {};
        p.type = cudaGraphNodeTypeConditional;
        p.conditional.handle = hs.h[r];
        p.conditional.type = cudaGraphCondTypeSwitch;
        p.conditional.size = (unsigned int)experts;
        cudaGraphNode_t node;
        const std::vector<cudaGraphNode_t>& d = (chain && !ends.empty()) ? std::vector<cudaGraphNode_t>{ends.back()} : after;
        CHECK(cudaGraphAddNode(&node, graph, d.data(), nullptr, d.size(), &p), 5);
        for (int e = 0; e < experts; ++e) {
            cudaGraph_t body = p.conditional.phGraph_out[e];
            for (int m = 0; m < members; ++m) {
                cudaGraphNode_t mn;
                CHECK(cudaGraphAddMemcpyNode1D(&mn, body, nullptr, 0,
                                               (void*)dst[r * members + m],
                                               (const void*)src[e * members + m], bytes[m],
                                               cudaMemcpyHostToDevice), 6);
            }
        }
        if (chain && !ends.empty()) ends.back() = node; else ends.push_back(node);
    }
    CHECK(cudaStreamUpdateCaptureDependencies(stream, ends.data(), nullptr, ends.size(),
                                              cudaStreamSetCaptureDependencies), 7);
    return 0;
}
