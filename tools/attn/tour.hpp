// `attn tour --out DIR`: every demonstration of the chapter, run now, collected in
// DIR/index.html with its figures beside it.
//
// Extension point: the page is a list of sections (tour_sections() in tour.cpp). To add one,
// write a function `void my_section(Tour& tour)` (in its own tools/attn/tour_*.cpp if it is
// long) that appends a section to tour.report and writes its files with tour.write(...), declare
// it below, and append {"my-id", my_section} to the list. Sections planned: "CNN vs RNN vs
// self-attention, measured" and "positional encoding matters: a trained model".
#pragma once

#include "viz/report.hpp"

#include <filesystem>
#include <string>
#include <vector>

namespace attn::cli {

struct Tour {
  std::filesystem::path dir;
  viz::Report report{"attn tour: self-attention and positional encoding"};
  std::vector<std::string> files;  // written so far, relative to dir

  // Writes `content` to dir/name atomically and returns `name` (the path index.html uses).
  std::string write(const std::string& name, const std::string& content);
};

using TourSectionFn = void (*)(Tour&);
struct TourSection {
  const char* id;
  TourSectionFn build;
};

// The sections in page order.
const std::vector<TourSection>& tour_sections();

// Builds the whole tour into `dir` (created if missing); returns the path of index.html.
// Runs every section into `dir` except those named in `skip` (an unknown name is an Error).
std::filesystem::path run_tour(const std::filesystem::path& dir,
                               const std::vector<std::string>& skip = {});

// The sections of the chapter (tour.cpp).
void tour_self_attention(Tour& tour);
void tour_encoding_matrix(Tour& tour);
void tour_absolute_position(Tour& tour);
void tour_relative_position(Tour& tour);
// cmd_compare.cpp: the CNN / RNN / self-attention table measured with `attn compare --quick`.
void tour_cnn_rnn_attention(Tour& tour);
// The positional-encoding experiment, quick setting (cmd_experiment.cpp).
void tour_positional_experiment(Tour& tour);
// tour_seq2seq.cpp: the four requirements of a positional encoding checked on P; n -> m (trains
// the dates task: translations, alignment heatmap, decode time with and without the KV cache,
// learned embeddings).
void tour_pe_requirements(Tour& tour);
void tour_seq2seq(Tour& tour);

}  // namespace attn::cli
