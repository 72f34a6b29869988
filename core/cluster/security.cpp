#include "core/cluster/security.hpp"

#include "core/cluster/head_link.hpp"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

namespace {

std::string from_env(const std::string& flag, const char* env) {
  if (!flag.empty()) return flag;
  const char* v = std::getenv(env);
  return v ? v : "";
}

// The explicit path, else the default file when it exists, else "".
std::string pick(const std::string& given, const char* env, const char* default_name) {
  std::string v = from_env(given, env);
  if (!v.empty()) return v;
  const auto d = twinkle_home() / default_name;
  std::error_code ec;
  return std::filesystem::exists(d, ec) ? d.string() : "";
}

void warn_insecure(const std::string& what) {
  std::fprintf(stderr,
               "twinkle: WARNING: --insecure: %s without keys: anyone who can reach it can run "
               "code on every node of this cluster; use `twinkle keygen` and drop --insecure\n",
               what.c_str());
  std::fflush(stderr);
}

}  // namespace

std::filesystem::path twinkle_home() {
  if (const char* h = std::getenv("TWINKLE_HOME"); h && *h) return h;
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home && *home ? home : "/") / ".twinkle";
}

HeadSecurity head_security(const KeyOptions& o, const std::string& bind_host) {
  HeadSecurity out;
  const std::string key = pick(o.key, "TWINKLE_KEY", "twinkle.key");
  if (key.empty()) {
    if (!transport::is_loopback_host(bind_host)) {
      if (!o.insecure) {
        throw ConfigError(fmt::format(
            "the head would listen on {} without keys, so anyone who reaches it could run code "
            "on every node; create a key pair with `twinkle keygen` (it is found in {}), bind "
            "loopback only (--bind 127.0.0.1), or pass --insecure",
            bind_host, twinkle_home().string()));
      }
      warn_insecure(fmt::format("the head listens on {}", bind_host));
    }
    return out;
  }
  out.socket.keys = transport::read_keypair(key);
  out.allowed.insert(out.socket.keys->public_key);
  out.names[out.socket.keys->public_key] = "head";
  out.admins.insert("head");
  const std::string allow = pick(o.authorized_keys, "TWINKLE_AUTHORIZED_KEYS", "authorized_keys");
  if (allow.empty()) {
    throw ConfigError(fmt::format(
        "the head has a key ({}) but no allow-list: put the public keys of the members that may "
        "join (their twinkle.pub) in {} or pass --authorized-keys FILE",
        key, (twinkle_home() / "authorized_keys").string()));
  }
  for (auto& m : transport::read_members(allow)) {
    if (m.name == "head" && m.key != out.socket.keys->public_key) {
      throw ConfigError(fmt::format(
          "{}: the member name \"head\" is the head's own; give that key another name", allow));
    }
    out.allowed.insert(m.key);
    if (m.admin) out.admins.insert(m.name);
    if (auto t = out.teams.find(m.name); t != out.teams.end() && t->second != m.team) {
      throw ConfigError(fmt::format(
          "{}: the member \"{}\" is in team {} on one line and in team {} on another; give "
          "each of its keys the same team=",
          allow, m.name, t->second, m.team));
    }
    out.teams[m.name] = m.team;
    if (m.key != out.socket.keys->public_key) out.names[m.key] = std::move(m.name);
  }
  return out;
}

transport::SocketSecurity member_security(const KeyOptions& o, const std::string& address) {
  transport::SocketSecurity out;
  // A cluster made for one run (the Slurm launcher) hands its members their keys directly.
  if (const char* session = std::getenv("TWINKLE_SESSION_KEYS"); session && o.key.empty()) {
    std::istringstream in(session);
    transport::KeyPair k;
    std::string head;
    in >> k.public_key >> k.secret_key >> head;
    if (!transport::is_z85_key(k.public_key) || !transport::is_z85_key(k.secret_key) ||
        !transport::is_z85_key(head)) {
      throw ConfigError("TWINKLE_SESSION_KEYS must hold three Z85 keys: public, secret, head's");
    }
    out.keys = k;
    out.server_key = head;
    return out;
  }
  const std::string key = pick(o.key, "TWINKLE_KEY", "twinkle.key");
  if (key.empty()) {
    if (!transport::is_loopback_host(endpoint_host(address))) {
      if (!o.insecure) {
        throw ConfigError(fmt::format(
            "{} is not a loopback address and this member has no key, so it would talk in "
            "plaintext; create a key pair with `twinkle keygen`, give it the head's public key "
            "(--head-key or {}), or pass --insecure",
            address, (twinkle_home() / "head.pub").string()));
      }
      warn_insecure(fmt::format("talking to {}", address));
    }
    return out;
  }
  out.keys = transport::read_keypair(key);
  std::string head = from_env(o.head_key, "TWINKLE_HEAD_KEY");
  if (head.empty()) {
    const auto d = twinkle_home() / "head.pub";
    std::error_code ec;
    if (std::filesystem::exists(d, ec)) head = d.string();
  }
  if (head.empty()) {
    throw ConfigError(fmt::format(
        "this member has a key ({}) but does not know the head's public key: copy the head's "
        "twinkle.pub to {} or pass --head-key KEY|FILE",
        key, (twinkle_home() / "head.pub").string()));
  }
  if (!transport::is_z85_key(head)) {
    std::ifstream in(head);
    std::string line;
    if (!in || !std::getline(in, line)) {
      throw ConfigError(fmt::format(
          "--head-key {}: neither a public key (40 Z85 characters) nor a readable file", head));
    }
    const std::string k = line.substr(0, line.find_first_of(" \t"));
    if (!transport::is_z85_key(k)) {
      throw ConfigError(fmt::format(
          "{}:1: not a public key (40 Z85 characters, as in a twinkle.pub written by keygen)",
          head));
    }
    head = k;
  }
  out.server_key = head;
  return out;
}

}  // namespace twinkle::core::cluster
