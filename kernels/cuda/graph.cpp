// CUDA graphs for GraphCacheCore (graph_cache.hpp): stream capture in thread-local mode, so that
// other threads' CUDA calls are not swept into the graph.
#include "attn/cuda/graph.hpp"

#include "kernels/cuda/check.hpp"

#include <cuda_runtime.h>

namespace attn::cuda {

GraphCache::GraphCache(void* stream)
    : core_(GraphOps{
          [stream](const std::function<void()>& body) -> void* {
            cudaStream_t s = static_cast<cudaStream_t>(stream);
            ATTN_CUDA_CHECK("cuda::GraphCache",
                            cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            try {
              body();
            } catch (...) {
              cudaGraph_t broken = nullptr;
              (void)cudaStreamEndCapture(s, &broken);
              if (broken != nullptr) (void)cudaGraphDestroy(broken);
              throw;
            }
            cudaGraph_t graph = nullptr;
            ATTN_CUDA_CHECK("cuda::GraphCache", cudaStreamEndCapture(s, &graph));
            cudaGraphExec_t exec = nullptr;
            const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
            (void)cudaGraphDestroy(graph);
            ATTN_CUDA_CHECK("cuda::GraphCache", err);
            return exec;
          },
          [stream](void* exec) {
            ATTN_CUDA_CHECK("cuda::GraphCache", cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec),
                                                                static_cast<cudaStream_t>(stream)));
          },
          [](void* exec) { (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)); }}) {
  require(stream != nullptr, "cuda::GraphCache",
          "graphs are captured on a stream of their own (attn::cuda::Stream), not the default one");
}

}  // namespace attn::cuda
