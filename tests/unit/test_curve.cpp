#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "transports/zmq/curve.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle::transport;
namespace fs = std::filesystem;

namespace {

// A fresh folder, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "twinkle-curve.XXXXXX").string();
    REQUIRE(mkdtemp(t.data()));
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const twinkle::ConfigError& e) {
    return e.what();
  }
  FAIL("no ConfigError");
  return "";
}

}  // namespace

TEST_CASE("a key pair is written privately and read back", "[curve]") {
  TempDir t;
  const KeyPair k = generate_keypair();
  CHECK(is_z85_key(k.public_key));
  CHECK(is_z85_key(k.secret_key));
  CHECK(k.public_key != k.secret_key);
  write_keypair(t.path / "keys", k, "me@host", false);
  struct stat st {};
  REQUIRE(stat((t.path / "keys" / "twinkle.key").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(stat((t.path / "keys").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  const KeyPair back = read_keypair(t.path / "keys" / "twinkle.key");
  CHECK(back.public_key == k.public_key);
  CHECK(back.secret_key == k.secret_key);
  // The public file is an allow-list line.
  const auto allowed = read_allowed_keys(t.path / "keys" / "twinkle.pub");
  REQUIRE(allowed.size() == 1);
  CHECK(allowed[0] == k.public_key);
}

TEST_CASE("an existing key pair is kept unless forced", "[curve]") {
  TempDir t;
  write_keypair(t.path, generate_keypair(), "", false);
  CHECK_THAT(error_of([&] { write_keypair(t.path, generate_keypair(), "", false); }),
             Catch::Contains("twinkle.key already exists; keep it, or pass --force"));
  const KeyPair k = generate_keypair();
  write_keypair(t.path, k, "", true);
  CHECK(read_keypair(t.path / "twinkle.key").public_key == k.public_key);
}

TEST_CASE("a secret key others can read is refused", "[curve]") {
  TempDir t;
  write_keypair(t.path, generate_keypair(), "", false);
  chmod((t.path / "twinkle.key").c_str(), 0644);
  CHECK_THAT(error_of([&] { read_keypair(t.path / "twinkle.key"); }),
             Catch::Contains("other users can read this secret key (mode 644); run chmod 600"));
  CHECK_THAT(error_of([&] { read_keypair(t.path / "missing.key"); }),
             Catch::Contains("missing.key: no such key file; make one with `twinkle keygen`"));
}

TEST_CASE("allow-lists skip comments and name a bad line", "[curve]") {
  TempDir t;
  const KeyPair a = generate_keypair(), b = generate_keypair();
  std::ofstream(t.path / "allowed") << "# the cluster\n\n"
                                    << a.public_key << " alice@x\n"
                                    << b.public_key << "\n";
  const auto keys = read_allowed_keys(t.path / "allowed");
  REQUIRE(keys.size() == 2);
  CHECK(keys[0] == a.public_key);
  CHECK(keys[1] == b.public_key);
  std::ofstream(t.path / "bad") << a.public_key << "\nnot-a-key\n";
  CHECK_THAT(error_of([&] { read_allowed_keys(t.path / "bad"); }),
             Catch::Contains("bad:2: \"not-a-key\" is not a public key"));
}
