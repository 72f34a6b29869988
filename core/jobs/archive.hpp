#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "transports/zmq/protocol.hpp"

// A submitted job's working directory as one archive (docs/ARCHITECTURE.md, Job service): a tar
// made with libarchive, its entries in name order with owners cleared, so that the same folder
// packs to the same bytes and its sha256 names it; the head keeps one copy per sha256.
namespace twinkle::core::jobs {

struct PackedDir {
  std::vector<std::uint8_t> bytes;
  std::string sha256;  // hex
  std::size_t files = 0;
  std::vector<std::string> ignored;  // paths left out by .twinkleignore
};

// Packs regular files, folders and symbolic links under `dir`, leaving out what the globs of
// `dir/.twinkleignore` match (one per line, '#' comments; a glob without '/' matches a name at
// any depth, one with '/' (a leading one too) the path from `dir`; a trailing '/' only folders).
// Throws ConfigError naming the folder, the limit and the fix when the files add up to more than
// `limit` bytes.
PackedDir pack_dir(const std::filesystem::path& dir, std::uint64_t limit);

// The upload_part of `packed` that starts at byte `at` and holds at most `most` bytes (the last
// one says so).
transport::proto::UploadPart upload_piece(const PackedDir& packed, std::size_t at,
                                          std::size_t most);

// What libtwinkle_archive.so gives (twinkle_archive_ops_v1): libarchive, loaded by the first pack
// or unpack, so that `twinkle run` starts without mapping and relocating it and its libraries
// (about 1.4 ms of CPU per process on the development VM). Both return 0, or non-zero with
// `error` set to a message that names the file and the entry.
struct ArchiveOps {
  // Appends the tar of `names` (paths under `dir`, in this order) to `out`.
  int (*pack)(const std::filesystem::path& dir, const std::vector<std::string>& names,
              std::vector<std::uint8_t>* out, std::string* error);
  // Unpacks `file` into the folder `into` (which exists), with pack_dir's checks.
  int (*unpack)(const std::filesystem::path& file, const std::filesystem::path& into,
                std::string* error);
};

// Unpacks an archive made by pack_dir into `into` (created). Refuses entries with absolute
// paths, "..", or links that lead out of `into`; throws Error naming the entry.
void unpack(const std::filesystem::path& archive, const std::filesystem::path& into);

}  // namespace twinkle::core::jobs
