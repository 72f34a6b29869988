#include <unistd.h>

#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "core/cluster/security.hpp"
#include "transports/zmq/curve.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::cli {

namespace {

struct KeygenOptions {
  std::string out;
  std::string name;
  bool force = false;
};

std::string default_dir() { return core::cluster::twinkle_home().string(); }

// The member's name on the head (its allow-list line's second word): --name, else $USER.
std::string member_name(const KeygenOptions& o) {
  const char* user = std::getenv("USER");
  const std::string name = !o.name.empty() ? o.name : user && *user ? user : "user";
  const bool ok = name.size() <= 64 && name != "head" &&
                  name.find_first_not_of(
                      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                      "0123456789._@-") == std::string::npos;
  if (!ok) {
    throw ConfigError(fmt::format(
        "--name \"{}\": a member name is 1 to 64 of A-Z a-z 0-9 . _ @ - and not \"head\"", name));
  }
  return name;
}

int run_keygen(const KeygenOptions& o) {
  const std::string dir = o.out.empty() ? default_dir() : o.out;
  const std::string name = member_name(o);
  const transport::KeyPair keys = transport::generate_keypair();
  transport::write_keypair(dir, keys, name, o.force);
  fmt::print("wrote {0}/twinkle.key (private: this member's identity) and {0}/twinkle.pub\n", dir);
  fmt::print("public key: {}\n", keys.public_key);
  fmt::print(
      "to let this member into a cluster as \"{}\", add the line of twinkle.pub to the "
      "allow-list of the cluster's head (add \" admin\" to the line to let it stop anyone's "
      "jobs)\n",
      name);
  return 0;
}

}  // namespace

void setup_keygen(CLI::App& app, Action& action) {
  auto o = std::make_shared<KeygenOptions>();
  auto* sub = app.add_subcommand(
      "keygen", "Make the key pair a cluster member authenticates with (CurveZMQ)");
  sub->add_option(
      "--out", o->out,
      "Folder for twinkle.key and twinkle.pub (default: TWINKLE_HOME, else ~/.twinkle)");
  sub->add_option("--name", o->name,
                  "The member's name on the cluster, written into twinkle.pub (default: $USER)");
  sub->add_flag("--force", o->force, "Replace a key pair that is already there");
  sub->callback([o, &action] { action = [o] { return run_keygen(*o); }; });
}

}  // namespace twinkle::cli
