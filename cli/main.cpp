#include <fmt/format.h>

#include "cli/commands.hpp"
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

  return twinkle::cli::parse_and_run(app, argc, argv, action);
}
