#include "transports/zmq/curve.hpp"

#include <sys/stat.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

constexpr const char* kZ85 =
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t\r");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\r") - a + 1);
}

}  // namespace

bool is_z85_key(const std::string& key) {
  return key.size() == 40 && key.find_first_not_of(kZ85) == std::string::npos;
}

KeyPair generate_keypair() {
  char pub[41] = {}, sec[41] = {};
  if (zmq_curve_keypair(pub, sec) != 0) {
    throw TransportError(fmt::format(
        "cannot make a CURVE key pair: {}; this libzmq was built without libsodium (install "
        "Debian's libzmq5)",
        zmq_strerror(zmq_errno())));
  }
  return {pub, sec};
}

void write_keypair(const std::filesystem::path& dir, const KeyPair& keys,
                   const std::string& comment, bool overwrite) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(dir, ec);
  std::filesystem::create_directories(dir, ec);
  if (!ec && !existed) std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  if (ec) {
    throw ConfigError(fmt::format("--out {}: cannot create it ({}); choose another folder",
                                  dir.string(), ec.message()));
  }
  const auto key_file = dir / "twinkle.key";
  const auto pub_file = dir / "twinkle.pub";
  if (!overwrite && (std::filesystem::exists(key_file) || std::filesystem::exists(pub_file))) {
    throw ConfigError(fmt::format(
        "{} already exists; keep it, or pass --force to replace it (members that trust its "
        "public key will refuse the new one)",
        std::filesystem::exists(key_file) ? key_file.string() : pub_file.string()));
  }
  // The secret never exists with wider permissions, not even for a moment.
  const mode_t old = ::umask(077);
  std::ofstream key(key_file, std::ios::trunc);
  ::umask(old);
  key << "# twinkle key pair (CurveZMQ, Z85). Keep this file private: it is this member's "
         "identity.\n"
      << "public " << keys.public_key << "\n"
      << "secret " << keys.secret_key << "\n";
  key.close();
  ::chmod(key_file.c_str(), 0600);
  std::ofstream pub(pub_file, std::ios::trunc);
  pub << keys.public_key << (comment.empty() ? "" : " " + comment) << "\n";
  pub.close();
  if (!key || !pub) {
    throw ConfigError(fmt::format("cannot write {}: {}; choose a writable folder with --out",
                                  !key ? key_file.string() : pub_file.string(),
                                  std::strerror(errno)));
  }
}

KeyPair read_keypair(const std::filesystem::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    throw ConfigError(
        fmt::format("{}: no such key file; make one with `twinkle keygen`", file.string()));
  }
  if (st.st_mode & 077) {
    throw ConfigError(
        fmt::format("{}: other users can read this secret key (mode {:o}); run chmod 600 {}",
                    file.string(), st.st_mode & 0777, file.string()));
  }
  std::ifstream in(file);
  KeyPair k;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    std::string what, value;
    words >> what >> value;
    if ((what != "public" && what != "secret") || !is_z85_key(value)) {
      throw ConfigError(
          fmt::format("{}:{}: not a key line (\"public KEY\" or \"secret KEY\", 40 Z85 characters)",
                      file.string(), n));
    }
    (what == "public" ? k.public_key : k.secret_key) = value;
  }
  if (k.public_key.empty() || k.secret_key.empty()) {
    throw ConfigError(fmt::format("{}: lacks its {} key; make a new pair with `twinkle keygen`",
                                  file.string(), k.public_key.empty() ? "public" : "secret"));
  }
  return k;
}

std::vector<std::string> read_allowed_keys(const std::filesystem::path& file) {
  std::vector<std::string> keys;
  for (auto& m : read_members(file)) keys.push_back(std::move(m.key));
  return keys;
}

std::vector<Member> read_members(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) {
    throw ConfigError(
        fmt::format("{}: cannot read this allow-list: {}", file.string(), std::strerror(errno)));
  }
  std::vector<Member> members;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    Member m;
    words >> m.key >> m.name;
    if (!is_z85_key(m.key)) {
      throw ConfigError(fmt::format(
          "{}:{}: \"{}\" is not a public key (40 Z85 characters, as in a twinkle.pub file)",
          file.string(), n, m.key.substr(0, 48)));
    }
    if (m.name.find('=') != std::string::npos) {
      throw ConfigError(
          fmt::format("{}:{}: \"{}\" where the member's name goes; a line is `<public key> NAME "
                      "[team=TEAM] [admin]`",
                      file.string(), n, m.name.substr(0, 48)));
    }
    for (std::string extra; words >> extra;) {
      if (extra == "admin") {
        m.admin = true;
      } else if (extra.rfind("team=", 0) == 0) {
        m.team = extra.substr(5);
        if (m.team.empty() || m.team.size() > 64 ||
            m.team.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_-") !=
                std::string::npos) {
          throw ConfigError(
              fmt::format("{}:{}: team \"{}\": a team's name is 1 to 64 of a-z, 0-9, _ and -",
                          file.string(), n, m.team.substr(0, 48)));
        }
      } else {
        throw ConfigError(fmt::format(
            "{}:{}: \"{}\" after the name; a line is `<public key> NAME [team=TEAM] [admin]`",
            file.string(), n, extra.substr(0, 48)));
      }
    }
    if (m.name.empty()) m.name = "key-" + m.key.substr(0, 8);
    members.push_back(std::move(m));
  }
  return members;
}

}  // namespace twinkle::transport
