#include <cstdio>
#include <exception>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/exit_codes.hpp"
#include "transports/zmq/protocol.hpp"
#include "twinkle/plugin.h"
#include "twinkle_config.h"

namespace {

// What a bug report or a cluster upgrade needs to know: members talk only with equal protocol
// versions, and plugins load only with an equal ABI version.
std::string version_text() {
  return fmt::format(
      "twinkle {}\nplugin ABI version: {}\nwire protocol version: {}\nCUDA: {}\nNCCL: {}",
      TWINKLE_VERSION, TWK_ABI_VERSION, twinkle::transport::kProtocolVersion,
      TWINKLE_HAVE_CUDA ? "yes" : "no", TWINKLE_HAVE_NCCL ? "yes" : "no");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"twinkle: run distributed C++ model code on one machine or a cluster", "twinkle"};
  app.set_version_flag("--version", version_text());
  app.require_subcommand(1);
  app.footer(
      "Run `twinkle COMMAND --help` for a command's options; man twinkle for the whole story.");

  twinkle::cli::Action action;
  twinkle::cli::setup_run(app, action);
  twinkle::cli::setup_topology(app, action);
  twinkle::cli::setup_nodes(app, action);
  twinkle::cli::setup_node(app, action);
  twinkle::cli::setup_inspect(app, action);
  twinkle::cli::setup_jobs(app, action);
  twinkle::cli::setup_keygen(app, action);
  twinkle::cli::setup_worker(app, action);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return twinkle::cli::kExitUsage;
  }

  try {
    return action ? action() : twinkle::cli::kExitUsage;
  } catch (const twinkle::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "twinkle: {}\n", e.what());
    return twinkle::cli::exit_code_for(e);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "twinkle: internal error: {}\n", e.what());
    return twinkle::cli::kExitJobFailed;
  }
}
