// attn::cli::run: the whole command line as a function (main() calls it; the argument fuzzer
// in fuzz/ calls it in-process, once per input, so it keeps no state between calls).
//
// Exit status: 0 on success (and for --help), 2 for a bad flag or value (one line on stderr,
// "attn: <what is wrong>"), 1 for an unexpected internal failure.
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "tools/attn/commands.hpp"

#include <cstdio>
#include <exception>
#include <string>

namespace attn::cli {

namespace {

// Error messages (ours, CLI11's, the library's) on exactly one line.
std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  while (!text.empty() && text.back() == ' ')
    text.pop_back();
  return text;
}

// Under mpirun with N > 1 ranks (attn train), a failing rank ends the whole run: the others may
// be waiting in a collective for it.
int fail(int status, const std::string& message) {
  std::fprintf(stderr, "attn: %s\n", one_line(message).c_str());
  std::fflush(stderr);
  abort_world_if_parallel(status);
  return status;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{
      "attn: self-attention, multi-head attention and positional encoding (d2l chapter 11.6).\n"
      "Every subcommand has --help; `attn tour --out DIR` runs them all into DIR/index.html.",
      "attn"};
  app.require_subcommand(1);
  std::vector<Command> commands;
  try {
    // To add a subcommand: write add_<name>_command (see commands.hpp) and list it here.
    for (auto add :
         {add_self_attention_command, add_pe_command, add_train_command, add_data_command,
          add_translate_command, add_predict_command, add_experiment_command, add_compare_command,
          add_bench_command, add_tour_command}) {
      for (auto& c : add(app))
        commands.push_back(std::move(c));
    }
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and friends: CLI11 prints the (sub)command's help on stdout and we exit 0.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    return fail(2, e.what());
  } catch (const Error& e) {
    return fail(2, e.what());
  }

  try {
    for (const auto& c : commands) {
      if (c.app->parsed()) {
        c.run();
        break;
      }
    }
  } catch (const Error& e) {
    return fail(2, e.what());
  } catch (const std::exception& e) {
    return fail(1, std::string("internal error: ") + e.what());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace attn::cli
