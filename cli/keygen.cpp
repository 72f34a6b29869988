#include <unistd.h>

#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "transports/zmq/curve.hpp"

namespace twinkle::cli {

namespace {

struct KeygenOptions {
  std::string out;
  bool force = false;
};

std::string default_dir() {
  const char* home = std::getenv("HOME");
  return fmt::format("{}/.twinkle", home && *home ? home : ".");
}

std::string whoami() {
  const char* user = std::getenv("USER");
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return fmt::format("{}@{}", user && *user ? user : "user", host);
}

int run_keygen(const KeygenOptions& o) {
  const std::string dir = o.out.empty() ? default_dir() : o.out;
  const transport::KeyPair keys = transport::generate_keypair();
  transport::write_keypair(dir, keys, whoami(), o.force);
  fmt::print("wrote {0}/twinkle.key (private: this member's identity) and {0}/twinkle.pub\n", dir);
  fmt::print("public key: {}\n", keys.public_key);
  fmt::print(
      "to let this member into a cluster, add the line of twinkle.pub to the allow-list of "
      "the cluster's head and agents\n");
  return 0;
}

}  // namespace

void setup_keygen(CLI::App& app, Action& action) {
  auto o = std::make_shared<KeygenOptions>();
  auto* sub = app.add_subcommand(
      "keygen", "Make the key pair a cluster member authenticates with (CurveZMQ)");
  sub->add_option("--out", o->out, "Folder for twinkle.key and twinkle.pub (default ~/.twinkle)");
  sub->add_flag("--force", o->force, "Replace a key pair that is already there");
  sub->callback([o, &action] { action = [o] { return run_keygen(*o); }; });
}

}  // namespace twinkle::cli
