#pragma once

#include <cstdio>
#include <exception>
#include <functional>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "cli/exit_codes.hpp"

namespace twinkle::cli {

// Each subcommand registers itself on `app` and, when chosen, stores its run function in `action`.
// main() calls `action` after parsing, inside the error handler that maps errors to exit codes.
using Action = std::function<int()>;

void setup_topology(CLI::App& app, Action& action);
void setup_nodes(CLI::App& app, Action& action);
void setup_node(CLI::App& app, Action& action);
void setup_inspect(CLI::App& app, Action& action);
void setup_run(CLI::App& app, Action& action);
void setup_keygen(CLI::App& app, Action& action);
void setup_jobs(CLI::App& app, Action& action);

// The body of main() of both binaries (`twinkle` and `twinkle-worker`): parses the command line
// into `app`, then runs `action` (what parsing chose, for `twinkle`), printing an error that
// reaches it as "twinkle: ..." and turning it into the exit code.
inline int parse_and_run(CLI::App& app, int argc, char** argv, const Action& action) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }
  try {
    return action ? action() : kExitUsage;
  } catch (const Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "twinkle: {}\n", e.what());
    return exit_code_for(e);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "twinkle: internal error: {}\n", e.what());
    return kExitJobFailed;
  }
}

}  // namespace twinkle::cli
