// safetensors reader and writer (format: github.com/huggingface/safetensors, "Format" section).
//
// File layout:
//   [0, 8)          N, the header length, u64 little-endian
//   [8, 8 + N)      UTF-8 JSON object, possibly padded with trailing spaces
//   [8 + N, end)    the data area; each tensor's data_offsets [b, e) are relative to its start
//
// The reader trusts nothing: every size is checked against the bytes actually present before
// anything is allocated or copied, so a hostile file costs at most O(file size) memory and ends
// in attn::Error, never in a crash (fuzz/fuzz_safetensors.cpp checks this). Validation happens
// once, in parse_header, shared by the in-memory parser and the streaming file reader.
#include "attn/core/safetensors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <vector>

#include <sys/stat.h>

namespace attn {

// Tensor bytes are copied verbatim between memory and file, which is only right when the host
// is little-endian like the format. Every target we build for is; a big-endian port would
// byte-swap in read_entries/write_data.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

namespace {

using nlohmann::json;

constexpr const char* kLoadOp = "safetensors::load";
constexpr const char* kSaveOp = "safetensors::save";
// The Rust reference implementation refuses headers over 100 MB; so do we. A real header is
// ~100 bytes per tensor, so this allows about a million tensors.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Legitimate headers nest 3 deep ({name: {shape: [..]}}); deeper input is hostile and would
// only cost stack and time.
constexpr int kMaxJsonDepth = 16;

// Throws Error("safetensors::load", "<file>: <message>") unless `condition` holds.
template <typename... Args>
void expect(bool condition, const std::string& file, fmt::format_string<Args...> format,
            Args&&... args) {
  if (!condition) [[unlikely]] {
    throw Error(kLoadOp, file + ": " + fmt::format(format, std::forward<Args>(args)...));
  }
}

// One validated header entry: the tensor occupies data area bytes [begin, end).
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin;
  uint64_t end;
};

struct Header {
  std::vector<Entry> entries;  // sorted by offset: they tile the data area in this order
  std::map<std::string, std::string> metadata;
};

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = v << 8 | p[i];
  return v;
}

void check_header_length(uint64_t n, uint64_t file_size, const std::string& file) {
  expect(n <= kMaxHeaderBytes, file, "header length {} exceeds the {}-byte limit", n,
         kMaxHeaderBytes);
  expect(n <= file_size - 8, file, "header length {} exceeds the {} bytes after the length field",
         n, file_size - 8);
}

// Dtypes other libraries write that attn does not compute in: named so the error says
// "unsupported" (a real file attn cannot use) rather than "unknown" (a corrupt file).
bool is_foreign_dtype(std::string_view s) {
  for (std::string_view d : {"BOOL", "U8", "I8", "U16", "I16", "U32", "U64", "F8_E4M3", "F8_E5M2",
                             "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"}) {
    if (s == d) return true;
  }
  return false;
}

DType parse_dtype(const json& v, const std::string& file, const std::string& tensor) {
  expect(v.is_string(), file, "tensor '{}': dtype must be a string, found {}", tensor,
         v.type_name());
  const std::string& s = v.get_ref<const std::string&>();
  for (DType t : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
    if (s == dtype_name(t)) return t;
  }
  expect(!is_foreign_dtype(s), file,
         "tensor '{}': unsupported dtype '{}', expected one of F32, F64, BF16, F16, I32, I64",
         tensor, s);
  expect(false, file,
         "tensor '{}': unknown dtype '{}', expected one of F32, F64, BF16, F16, I32, I64", tensor,
         s);
  return DType::F32;  // unreachable
}

// Non-negative JSON integer that fits in int64 (nlohmann stores those as number_unsigned).
bool read_index(const json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return *out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

Shape parse_shape(const json& v, const std::string& file, const std::string& tensor) {
  expect(v.is_array(), file, "tensor '{}': shape must be an array, found {}", tensor,
         v.type_name());
  Shape shape;
  shape.reserve(v.size());
  for (const json& d : v) {
    uint64_t n = 0;
    expect(read_index(d, &n), file,
           "tensor '{}': shape {} has dimension {}, expected a non-negative integer below 2^63",
           tensor, v.dump(), d.dump());
    shape.push_back(static_cast<int64_t>(n));
  }
  // Both the element count and the largest contiguous stride (product of max(d, 1)) must fit
  // in int64, or Tensor's stride arithmetic would overflow even for an empty tensor.
  int64_t product = 1;
  for (int64_t d : shape) {
    int64_t f = std::max<int64_t>(d, 1);
    expect(product <= std::numeric_limits<int64_t>::max() / f, file,
           "tensor '{}': shape {} has more elements than fit in int64", tensor, shape_str(shape));
    product *= f;
  }
  return shape;
}

Entry parse_entry(const std::string& name, const json& v, uint64_t data_size,
                  const std::string& file) {
  expect(v.is_object(), file, "tensor '{}': entry must be an object, found {}", name,
         v.type_name());
  for (const auto& [key, unused] : v.items()) {
    expect(key == "dtype" || key == "shape" || key == "data_offsets", file,
           "tensor '{}': unexpected key '{}', expected only dtype, shape, data_offsets", name, key);
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    expect(v.contains(key), file, "tensor '{}': missing key '{}'", name, key);
  }
  Entry e{name, parse_dtype(v["dtype"], file, name), parse_shape(v["shape"], file, name), 0, 0};

  const json& off = v["data_offsets"];
  expect(off.is_array() && off.size() == 2 && read_index(off[0], &e.begin) &&
             read_index(off[1], &e.end),
         file, "tensor '{}': data_offsets is {}, expected [begin, end] of non-negative integers",
         name, off.dump());
  expect(e.begin <= e.end, file, "tensor '{}': data_offsets [{}, {}] has begin > end", name,
         e.begin, e.end);
  expect(e.end <= data_size, file,
         "tensor '{}': data_offsets [{}, {}] end beyond the data area of {} bytes", name, e.begin,
         e.end, data_size);

  // numel * size == end - begin, checked by division so that no product can overflow.
  const uint64_t bytes = e.end - e.begin;
  const uint64_t size = dtype_size(e.dtype);
  const auto numel = static_cast<uint64_t>(shape_numel(e.shape, kLoadOp));
  expect(bytes % size == 0 && bytes / size == numel, file,
         "tensor '{}': data_offsets [{}, {}] span {} bytes, expected {} elements * {} bytes for "
         "shape {} of {}",
         name, e.begin, e.end, bytes, numel, size, shape_str(e.shape), dtype_name(e.dtype));
  return e;
}

// Parses the JSON with a callback that rejects duplicate keys (nlohmann would silently keep the
// last one, letting two readers disagree about a file) and deep nesting.
json parse_json(const char* p, size_t n, const std::string& file) {
  std::vector<std::unordered_set<std::string>> keys;  // one set per open object
  std::string entry;                                  // the top-level key being parsed
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        expect(depth < kMaxJsonDepth, file, "header nests deeper than {} levels", kMaxJsonDepth);
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        bool fresh = keys.empty() || keys.back().insert(k).second;
        if (keys.size() <= 1) {
          expect(fresh, file, "tensor '{}': duplicate name in header", k);
          entry = k;
        } else {
          expect(fresh, file, "tensor '{}': duplicate key '{}'", entry, k);
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(p, p + n, callback);
  } catch (const json::exception& e) {
    expect(false, file, "header is not valid JSON: {}", e.what());
  }
  return {};
}

// Validates the header of a file whose data area holds `data_size` bytes.
Header parse_header(const char* p, size_t n, uint64_t data_size, const std::string& file) {
  // The spec requires the header to start with '{' (no leading whitespace or BOM).
  expect(n > 0 && p[0] == '{', file, "header must start with '{{', found {}",
         n == 0 ? std::string("an empty header")
                : fmt::format("byte 0x{:02x}", static_cast<unsigned char>(p[0])));
  // nlohmann's lexer stops at a NUL byte as if the input ended, which would let bytes after it
  // (anything, not just the spaces the spec allows) pass unread. Valid JSON never holds a raw NUL.
  const void* nul = std::memchr(p, '\0', n);
  expect(nul == nullptr, file, "header holds a NUL byte at offset {}, expected JSON text",
         nul ? static_cast<const char*>(nul) - p : 0);
  json root = parse_json(p, n, file);
  expect(root.is_object(), file, "header is {}, expected a JSON object", root.type_name());

  Header h;
  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      expect(value.is_object(), file, "__metadata__ is {}, expected an object of strings",
             value.type_name());
      for (const auto& [k, v] : value.items()) {
        expect(v.is_string(), file, "__metadata__ '{}' is {}, expected a string", k, v.type_name());
        h.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    h.entries.push_back(parse_entry(name, value, data_size, file));
  }

  // The tensors must tile [0, data_size) exactly: sorted by offset, each begins where the
  // previous ends. Empty tensors ([b, b]) fit anywhere on a boundary.
  std::sort(h.entries.begin(), h.entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const Entry& e : h.entries) {
    expect(e.begin >= cursor, file,
           "tensor '{}': data_offsets [{}, {}] overlap tensor '{}' ending at {}", e.name, e.begin,
           e.end, previous ? *previous : "", cursor);
    expect(e.begin == cursor, file,
           "tensor '{}': data_offsets [{}, {}] leave a gap of {} bytes at offset {}", e.name,
           e.begin, e.end, e.begin - cursor, cursor);
    cursor = e.end;
    previous = &e.name;
  }
  expect(cursor == data_size, file,
         "tensors cover {} bytes of the {}-byte data area, expected all of it", cursor, data_size);
  return h;
}

using FilePtr = std::unique_ptr<std::FILE, int (*)(std::FILE*)>;

std::string errno_str() {
  return std::strerror(errno);
}

// Writes to "<path>.tmp" and removes it unless commit() renamed it over `path`, so an error
// anywhere (including a throwing Tensor::contiguous) leaves neither a partial file nor a .tmp.
class TempFile {
 public:
  explicit TempFile(const std::string& path) : path_(path), tmp_(path + ".tmp") {
    file_ = std::fopen(tmp_.c_str(), "wb");
    check(file_ != nullptr, kSaveOp, "{}: cannot create {}: {}", path_, tmp_, errno_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (file_) std::fclose(file_);
    if (!committed_) std::remove(tmp_.c_str());
  }
  void write(const void* p, size_t n) {
    if (n == 0) return;
    check(std::fwrite(p, 1, n, file_) == n, kSaveOp, "{}: cannot write {}: {}", path_, tmp_,
          errno_str());
  }
  void commit() {
    std::FILE* f = file_;
    file_ = nullptr;
    // fclose flushes; a full disk often shows up only here.
    check(std::fclose(f) == 0, kSaveOp, "{}: cannot write {}: {}", path_, tmp_, errno_str());
    check(std::rename(tmp_.c_str(), path_.c_str()) == 0, kSaveOp, "{}: cannot rename {} to it: {}",
          path_, tmp_, errno_str());
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
  bool committed_ = false;
};

// A JSON string literal; throws Error when `s` is not valid UTF-8 (JSON cannot hold it).
std::string json_string(const std::string& s, const std::string& path, const char* what) {
  try {
    return json(s).dump();
  } catch (const json::exception&) {
    throw Error(kSaveOp, fmt::format("{}: {} {} is not valid UTF-8", path, what,
                                     json(s).dump(-1, ' ', true, json::error_handler_t::replace)));
  }
}

}  // namespace

SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& name) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  expect(size >= 8, name, "file is {} bytes, shorter than the 8-byte header length", size);
  const uint64_t n = read_u64_le(bytes);
  check_header_length(n, size, name);
  const char* header = reinterpret_cast<const char*>(bytes + 8);
  const unsigned char* area = bytes + 8 + n;
  Header h = parse_header(header, n, size - 8 - n, name);

  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (const Entry& e : h.entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (e.end > e.begin) std::memcpy(t.raw_data(), area + e.begin, e.end - e.begin);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

SafetensorsFile load_safetensors(const std::string& path) {
  FilePtr f(std::fopen(path.c_str(), "rb"), &std::fclose);
  expect(f != nullptr, path, "cannot open: {}", errno_str());
  struct stat st {};
  expect(fstat(fileno(f.get()), &st) == 0, path, "cannot stat: {}", errno_str());
  expect(S_ISREG(st.st_mode), path, "not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  expect(size >= 8, path, "file is {} bytes, shorter than the 8-byte header length", size);

  // Bounded reads: the header length is checked against the file size (and the 100 MB limit)
  // before its buffer is allocated, and each tensor is read straight into its own storage only
  // after the header proved that the tensors tile the rest of the file exactly.
  auto read_exact = [&](void* dst, size_t n, uint64_t at) {
    expect(n == 0 || std::fread(dst, 1, n, f.get()) == n, path,
           "file ended before byte {} of {} (truncated or changed while reading)", at + n, size);
  };
  unsigned char len[8];
  read_exact(len, 8, 0);
  const uint64_t n = read_u64_le(len);
  check_header_length(n, size, path);
  std::string header(n, '\0');
  read_exact(header.data(), n, 8);
  Header h = parse_header(header.data(), n, size - 8 - n, path);

  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (const Entry& e : h.entries) {  // in offset order, so the reads are sequential
    Tensor t = Tensor::empty(e.shape, e.dtype);
    read_exact(t.raw_data(), e.end - e.begin, 8 + n + e.begin);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Header: __metadata__ first, then the tensors in name order (std::map order) with offsets
  // packed in that order, so the same input always gives the same bytes.
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    const char* sep = "";
    for (const auto& [k, v] : metadata) {
      header +=
          sep + json_string(k, path, "metadata key") + ":" + json_string(v, path, "metadata value");
      sep = ",";
    }
    header += "}";
  }
  std::vector<Tensor> data;  // contiguous copies of strided inputs, in file order
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    check(name != "__metadata__", kSaveOp, "{}: '__metadata__' is reserved, not a tensor name",
          path);
    check(t.defined(), kSaveOp, "{}: tensor '{}' is undefined", path, name);
    std::string shape;
    for (int64_t d : t.shape())
      shape += (shape.empty() ? "" : ",") + std::to_string(d);
    const uint64_t bytes = t.nbytes();
    header += fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          header.size() > 1 ? "," : "", json_string(name, path, "tensor name"),
                          dtype_name(t.dtype()), shape, offset, offset + bytes);
    offset += bytes;
    data.push_back(t.contiguous());
  }
  header += "}";
  // Pad with spaces so the data area starts 8-byte aligned (8 + N is a multiple of 8), which
  // lets a reader that maps the file use F64/I64 data in place.
  header.append((8 - header.size() % 8) % 8, ' ');

  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  TempFile out(path);
  out.write(len, 8);
  out.write(header.data(), header.size());
  for (const Tensor& t : data)
    out.write(t.raw_data(), t.nbytes());
  out.commit();
}

}  // namespace attn
