#include "core/jobs/archive.hpp"

#include <fnmatch.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <memory>

#include <fmt/format.h>

#include "core/job/digest.hpp"
#include "core/job/resources.hpp"
#include "transports/module.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::jobs {

namespace fs = std::filesystem;

namespace {

struct Glob {
  std::string pattern;
  bool dirs_only = false;
  bool anchored = false;  // has a '/': matched against the whole relative path
};

std::vector<Glob> read_ignore(const fs::path& dir) {
  std::vector<Glob> out;
  std::ifstream in(dir / ".twinkleignore");
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    Glob g;
    if (line.back() == '/') {
      g.dirs_only = true;
      line.pop_back();
    }
    // A leading '/' anchors the glob to the folder's top, as in .gitignore.
    g.anchored = line.find('/') != std::string::npos;
    if (!line.empty() && line[0] == '/') line.erase(0, 1);
    g.pattern = line;
    if (!g.pattern.empty()) out.push_back(std::move(g));
  }
  return out;
}

bool ignored(const std::vector<Glob>& globs, const std::string& rel, bool is_dir) {
  const std::string name = fs::path(rel).filename().string();
  for (const auto& g : globs) {
    if (g.dirs_only && !is_dir) continue;
    if (fnmatch(g.pattern.c_str(), (g.anchored ? rel : name).c_str(), FNM_PATHNAME) == 0)
      return true;
  }
  return false;
}

struct Entry {
  std::string rel;
  fs::file_status status;
  std::uintmax_t size = 0;
};

const ArchiveOps& ops() {
  static const ArchiveOps* const loaded = [] {
    using Fn = const ArchiveOps* (*)();
    return reinterpret_cast<Fn>(
        transport::module_symbol("libtwinkle_archive.so", "twinkle_archive_ops_v1"))();
  }();
  return *loaded;
}

}  // namespace

PackedDir pack_dir(const fs::path& dir, std::uint64_t limit) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw ConfigError(fmt::format("--working-dir {}: not a folder", dir.string()));
  }
  PackedDir out;
  const auto globs = read_ignore(dir);
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const fs::path rel = it->path().lexically_relative(dir);  // not relative(): it follows links
    const auto st = it->symlink_status();
    const bool is_dir = fs::is_directory(st);
    if (ignored(globs, rel.generic_string(), is_dir)) {
      out.ignored.push_back(rel.generic_string() + (is_dir ? "/" : ""));
      if (is_dir) it.disable_recursion_pending();
      continue;
    }
    if (!is_dir && !fs::is_regular_file(st) && !fs::is_symlink(st)) continue;  // sockets, fifos
    Entry e{rel.generic_string(), st, 0};
    if (fs::is_regular_file(st)) {
      e.size = fs::file_size(it->path());
      total += e.size;
      ++out.files;
      if (total > limit) {
        throw ConfigError(fmt::format(
            "the working directory {} holds more than the upload limit of {} (reached at {}); "
            "leave out what the job does not need with globs in {}/.twinkleignore (data sets, "
            "checkpoints, build folders), or raise --max-upload",
            dir.string(), format_bytes(limit), e.rel, dir.string()));
      }
    }
    entries.push_back(std::move(e));
  }
  if (ec) throw Error(fmt::format("{}: cannot list it: {}", dir.string(), ec.message()));
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.rel < b.rel; });

  std::vector<std::string> names;
  names.reserve(entries.size());
  for (const auto& e : entries) names.push_back(e.rel);
  out.bytes.reserve(total + entries.size() * 1024 + 4096);
  std::string error;
  if (ops().pack(dir, names, &out.bytes, &error) != 0) throw Error(error);
  out.sha256 = sha256_hex(out.bytes.data(), out.bytes.size());
  return out;
}

void unpack(const fs::path& file, const fs::path& into) {
  fs::create_directories(into);
  std::string error;
  if (ops().unpack(file, into, &error) != 0) throw Error(error);
}

transport::proto::UploadPart upload_piece(const PackedDir& packed, std::size_t at,
                                          std::size_t most) {
  const std::size_t n = std::min(most, packed.bytes.size() - std::min(at, packed.bytes.size()));
  transport::proto::UploadPart part;
  part.sha256 = packed.sha256;
  part.offset = static_cast<std::int64_t>(at);
  part.bytes.data.assign(packed.bytes.begin() + static_cast<std::ptrdiff_t>(at),
                         packed.bytes.begin() + static_cast<std::ptrdiff_t>(at + n));
  part.last = at + n == packed.bytes.size();
  return part;
}

}  // namespace twinkle::core::jobs
