#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "transports/zmq/auth.hpp"

// Which keys a cluster member uses (docs/ARCHITECTURE.md, Security), from flags, environment and
// the default files under ~/.twinkle, and the rule that plaintext stays on loopback.
namespace twinkle::core::cluster {

struct KeyOptions {
  std::string key;  // --key / TWINKLE_KEY: this member's key pair file
  std::string
      authorized_keys;    // --authorized-keys / TWINKLE_AUTHORIZED_KEYS: the head's allow-list
  std::string head_key;   // --head-key / TWINKLE_HEAD_KEY: the head's public key, or a file
  bool insecure = false;  // --insecure: plaintext beyond loopback, loudly
};

// ~/.twinkle (or $TWINKLE_HOME): where keygen writes and where members look by default.
std::filesystem::path twinkle_home();

// The head's side: its key pair and the public keys it admits (its own included, for the agent
// it runs). Without a key pair (none given, no ~/.twinkle/twinkle.key) the head is plaintext and
// may bind loopback only: `bind_host` elsewhere is refused unless `insecure` (then a warning is
// printed). Throws ConfigError naming the file or flag and the fix.
// Each allowed key has a member name (the allow-list's second word; the head's own key is
// "head"), and names marked `admin` may stop anyone's job (docs/ARCHITECTURE.md, Job service).
struct HeadSecurity {
  transport::SocketSecurity socket;
  std::set<std::string> allowed;
  std::map<std::string, std::string> names;  // public key -> member name
  std::set<std::string> admins;              // member names
  std::map<std::string, std::string> teams;  // member name -> team (allow-list's team=)
};
HeadSecurity head_security(const KeyOptions& o, const std::string& bind_host);

// A member's side (agent, driver, `twinkle nodes`) towards the head at `address`: its key pair
// and the head's pinned public key; plaintext only towards loopback unless `insecure`.
transport::SocketSecurity member_security(const KeyOptions& o, const std::string& address);

}  // namespace twinkle::core::cluster
