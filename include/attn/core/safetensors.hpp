// safetensors (huggingface/safetensors format): an 8-byte little-endian header length N, N bytes
// of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {str: str}}, then the raw little-endian data. Offsets are relative to the byte
// after the header; tensors must tile the data area without gaps or overlaps.
//
// Reading checks everything (header length within the file, valid JSON, known dtypes, offsets in
// bounds, size = numel * dtype size, no overlaps) and throws attn::Error naming the file and the
// tensor. Writing goes to "<path>.tmp" then renames, so a failed write never leaves a partial file.
#pragma once

#include "attn/core/tensor.hpp"

#include <map>
#include <string>

namespace attn {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;        // owning, contiguous, dtype as stored
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

SafetensorsFile load_safetensors(const std::string& path);
// Parses an in-memory file (the fuzzer's entry point); `name` is used in messages.
SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& name);

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace attn
