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

// Unpacks an archive made by pack_dir into `into` (created). Refuses entries with absolute
// paths, "..", or links that lead out of `into`; throws Error naming the entry.
void unpack(const std::filesystem::path& archive, const std::filesystem::path& into);

}  // namespace twinkle::core::jobs
