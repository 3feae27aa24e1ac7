// attn: the command line of the attn library. Each subcommand demonstrates one idea of d2l's
// "Self-attention and positional encoding" chapter; `attn tour` runs them all into an HTML page.
// The program is attn::cli::run (app.cpp), so the argument fuzzer can call it in-process.
#include "tools/attn/commands.hpp"

int main(int argc, char** argv) {
  return attn::cli::run(argc, argv);
}
