#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace twinkle::cli {

// Each subcommand registers itself on `app` and, when chosen, stores its run function in `action`.
// main() calls `action` after parsing, inside the error handler that maps errors to exit codes.
using Action = std::function<int()>;

void setup_topology(CLI::App& app, Action& action);
void setup_nodes(CLI::App& app, Action& action);
void setup_node(CLI::App& app, Action& action);
void setup_inspect(CLI::App& app, Action& action);
void setup_run(CLI::App& app, Action& action);
void setup_worker(CLI::App& app, Action& action);
void setup_keygen(CLI::App& app, Action& action);
void setup_jobs(CLI::App& app, Action& action);

}  // namespace twinkle::cli
