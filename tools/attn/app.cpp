// attn::cli::run: the whole command line as a function (main() calls it; the argument fuzzer
// in fuzz/ calls it in-process, once per input, so it keeps no state between calls).
//
// Exit status: 0 on success (and for --help, --version), 2 for a bad flag or value or an unknown
// subcommand (one line on stderr, "attn: <what is wrong>"), 1 for an unexpected internal failure.
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "tools/attn/commands.hpp"

#include <cstdio>
#include <exception>
#include <string>

#ifndef ATTN_VERSION
#define ATTN_VERSION "unknown"
#endif

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

// The subcommand words at the front of argv, checked before CLI11 parses: CLI11 reports an unknown
// word as "A subcommand is required" or as an unexpected argument, and `attn foo --help` prints
// the top-level help and exits 0, as if foo existed. Walks down while the next word names a
// subcommand; a word that does not, where a command with subcommands takes no positional
// arguments, is an unknown subcommand. The first word starting with '-' ends the walk.
// Returns the message, or "" when every leading word names a subcommand.
std::string unknown_subcommand(CLI::App& app, int argc, char** argv) {
  CLI::App* at = &app;
  std::string path = "attn";
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') break;
    const auto subs = at->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) break;
    CLI::App* next = nullptr;
    std::string names;
    for (CLI::App* sub : subs) {
      if (sub->check_name(argv[i])) next = sub;
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (next == nullptr) {
      if (!at->get_options([](const CLI::Option* o) { return o->get_positional(); }).empty()) break;
      return "unknown subcommand '" + std::string(argv[i]) + "' for `" + path +
             "`; expected one of: " + names + " (`" + path + " --help` lists them)";
    }
    at = next;
    path += " " + next->get_name();
  }
  return "";
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{
      "attn: self-attention, multi-head attention and positional encoding (d2l chapter 11.6).\n"
      "Every subcommand has --help; `attn tour --out DIR` runs them all into DIR/index.html.",
      "attn"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("attn ") + ATTN_VERSION,
                       "Print the version and exit");
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
    if (const std::string unknown = unknown_subcommand(app, argc, argv); !unknown.empty())
      return fail(2, unknown);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help, --version: CLI11 prints the (sub)command's help or the version on stdout, exit 0.
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
