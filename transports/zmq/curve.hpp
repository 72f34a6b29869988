#pragma once

#include <filesystem>
#include <string>
#include <vector>

// CurveZMQ keys: how members of a cluster prove who they are (docs/ARCHITECTURE.md, Security).
// Keys are 40-character Z85 text. A member keeps its key pair in a private file; the head and the
// agents keep the public keys they accept in an allow-list file, one key per line.
namespace twinkle::transport {

struct KeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters
};

// A new key pair. Throws TransportError when this libzmq has no CURVE (built without libsodium).
KeyPair generate_keypair();

// Writes DIR/twinkle.key (the pair, mode 0600) and DIR/twinkle.pub (the public key and `comment`,
// one line, ready to append to an allow-list), creating DIR with mode 0700. Refuses to replace
// an existing key unless `overwrite`. Throws ConfigError naming the file and the fix.
void write_keypair(const std::filesystem::path& dir, const KeyPair& keys,
                   const std::string& comment, bool overwrite);

// Reads a key pair file written by write_keypair. Throws ConfigError naming the file and the
// line when it is not one, or when others can read it.
KeyPair read_keypair(const std::filesystem::path& file);

// Reads an allow-list: one Z85 public key per line, optionally followed by a comment; blank lines
// and lines starting with '#' are skipped. Throws ConfigError naming the file and line of a
// malformed key.
std::vector<std::string> read_allowed_keys(const std::filesystem::path& file);

// A member of a head's allow-list (docs/ARCHITECTURE.md, Job service): the line
// `<public key> NAME [team=TEAM] [admin]`. A line with the key alone names its member "key-" and
// the key's first 8 characters; a member without team= is in the team "default".
struct Member {
  std::string key, name;
  std::string team = "default";
  bool admin = false;
};
// The same file read as members. Throws ConfigError naming the file and line of a malformed key,
// a team name that is not 1 to 64 of a-z, 0-9, _ and -, or another word after the name.
std::vector<Member> read_members(const std::filesystem::path& file);

// True when `key` is 40 characters of the Z85 alphabet.
bool is_z85_key(const std::string& key);

}  // namespace twinkle::transport
