// Atomic file output for everything the CLI writes (SVG, HTML, CSV): a failed or interrupted run
// never leaves a partial file behind, and a reader never sees one half-written.
#pragma once

#include <string>
#include <string_view>

namespace attn::viz {

// Writes `content` to a temporary file beside `path` ("<path>.tmp-<pid>-<n>"), flushes it, then
// renames it over `path` (rename(2) is atomic within a file system). On any failure the
// temporary file is removed and attn::Error("write_file", ...) names the path and the system's
// reason. Parent directories are not created.
void write_file_atomic(const std::string& path, std::string_view content);

}  // namespace attn::viz
