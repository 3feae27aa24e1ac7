// CUDA graphs, captured once per shape and replayed: a training step issues hundreds of small
// kernels, and launching them one by one costs more than they compute at d2l's sizes.
//
//   attn::cuda::Stream stream;
//   attn::cuda::GraphCache graphs(stream.handle());
//   step(...);                                   // once eagerly: allocations, cuBLASLt plans
//   graphs.run({"train_step", {B, T}}, [&] { step(...); });   // captured the first time
//
// A step is identified by a GraphKey (a name and the dimensions its kernels depend on). The
// captured work must not allocate and must use the same device buffers on every replay.
// GraphCacheCore is the bookkeeping over three operations (capture, launch, destroy), plain C++
// so that tests/cuda/test_cuda_host.cpp checks it on the CPU; GraphCache gives it CUDA's
// (kernels/cuda/graph.cpp). Builds with -DATTN_WITH_CUDA=ON only; no CUDA header here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace attn::cuda {

struct GraphKey {
  std::string name;
  std::vector<int64_t> dims;
  bool operator==(const GraphKey&) const = default;
};

struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const {
    size_t h = std::hash<std::string>{}(k.name);
    for (int64_t d : k.dims)
      h = h * 1099511628211ull ^ std::hash<int64_t>{}(d);
    return h;
  }
};

struct GraphOps {
  std::function<void*(const std::function<void()>&)> capture;  // records body, returns a graph
  std::function<void(void*)> launch;
  std::function<void(void*)> destroy;
};

class GraphCacheCore {
 public:
  explicit GraphCacheCore(GraphOps ops) : ops_(std::move(ops)) {}
  ~GraphCacheCore() { clear(); }
  GraphCacheCore(const GraphCacheCore&) = delete;
  GraphCacheCore& operator=(const GraphCacheCore&) = delete;

  // Launches the graph of `key`, capturing `body` into it the first time.
  void run(const GraphKey& key, const std::function<void()>& body) {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      it = graphs_.emplace(key, ops_.capture(body)).first;
      ++captures_;
    }
    ops_.launch(it->second);
    ++launches_;
  }
  void clear() {
    for (auto& [key, g] : graphs_)
      ops_.destroy(g);
    graphs_.clear();
  }
  size_t size() const { return graphs_.size(); }
  uint64_t captures() const { return captures_; }
  uint64_t launches() const { return launches_; }

 private:
  GraphOps ops_;
  std::unordered_map<GraphKey, void*, GraphKeyHash> graphs_;
  uint64_t captures_ = 0, launches_ = 0;
};

class GraphCache {
 public:
  explicit GraphCache(void* stream);  // a non-default stream (capture needs one)
  void run(const GraphKey& key, const std::function<void()>& body) { core_.run(key, body); }
  // Destroys every graph (their buffers moved, say); the next run of a key captures again.
  void clear() { core_.clear(); }
  size_t size() const { return core_.size(); }
  uint64_t captures() const { return core_.captures(); }
  uint64_t launches() const { return core_.launches(); }

 private:
  GraphCacheCore core_;
};

}  // namespace attn::cuda
