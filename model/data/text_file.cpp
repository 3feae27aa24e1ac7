// Reading a text data file (see model/data/text_file.hpp).
#include "model/data/text_file.hpp"

#include <fstream>
#include <sstream>

namespace attn::model::detail {

std::string read_text_file(const char* op, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(in.good(), op, "cannot open '{}'", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  check(!in.bad(), op, "cannot read '{}'", path);
  return ss.str();
}

}  // namespace attn::model::detail
