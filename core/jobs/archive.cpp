#include "core/jobs/archive.hpp"

#include <archive.h>
#include <archive_entry.h>
#include <fnmatch.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <memory>

#include <fmt/format.h>

#include "core/job/digest.hpp"
#include "core/job/resources.hpp"
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

// True when `rel`, normalised, climbs above its start.
bool escapes(const fs::path& rel) {
  const fs::path n = rel.lexically_normal();
  return !n.empty() && *n.begin() == "..";
}

using ArchivePtr = std::unique_ptr<archive, int (*)(archive*)>;

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

  ArchivePtr a(archive_write_new(), archive_write_free);
  archive_write_set_format_pax_restricted(a.get());
  archive_write_set_bytes_in_last_block(a.get(), 1);
  out.bytes.reserve(total + entries.size() * 1024 + 4096);
  struct Sink {
    std::vector<std::uint8_t>* bytes;
  } sink{&out.bytes};
  archive_write_open(
      a.get(), &sink, nullptr,
      [](archive*, void* s, const void* buf, size_t n) -> la_ssize_t {
        auto* b = static_cast<Sink*>(s)->bytes;
        const auto* p = static_cast<const std::uint8_t*>(buf);
        b->insert(b->end(), p, p + n);
        return static_cast<la_ssize_t>(n);
      },
      nullptr);
  std::vector<char> buf(1 << 20);
  for (const auto& e : entries) {
    const fs::path full = dir / e.rel;
    struct stat st {};
    if (lstat(full.c_str(), &st) != 0) continue;  // gone since it was listed
    std::unique_ptr<archive_entry, void (*)(archive_entry*)> entry(archive_entry_new(),
                                                                   archive_entry_free);
    archive_entry_set_pathname(entry.get(), e.rel.c_str());
    archive_entry_set_perm(entry.get(), st.st_mode & 07777);
    archive_entry_set_mtime(entry.get(), st.st_mtime, 0);
    if (S_ISDIR(st.st_mode)) {
      archive_entry_set_filetype(entry.get(), AE_IFDIR);
    } else if (S_ISLNK(st.st_mode)) {
      archive_entry_set_filetype(entry.get(), AE_IFLNK);
      archive_entry_set_symlink(entry.get(), fs::read_symlink(full).c_str());
    } else {
      archive_entry_set_filetype(entry.get(), AE_IFREG);
      archive_entry_set_size(entry.get(), st.st_size);
    }
    if (archive_write_header(a.get(), entry.get()) != ARCHIVE_OK) {
      throw Error(fmt::format("cannot pack {}: {}", full.string(), archive_error_string(a.get())));
    }
    if (S_ISREG(st.st_mode)) {
      std::ifstream in(full, std::ios::binary);
      if (!in) throw Error(fmt::format("cannot read {} to pack it", full.string()));
      la_int64_t left = st.st_size;
      while (left > 0 && in) {
        in.read(buf.data(), static_cast<std::streamsize>(
                                std::min<la_int64_t>(left, static_cast<la_int64_t>(buf.size()))));
        const auto got = in.gcount();
        if (got <= 0) break;
        archive_write_data(a.get(), buf.data(), static_cast<size_t>(got));
        left -= got;
      }
    }
  }
  archive_write_close(a.get());
  out.sha256 = sha256_hex(out.bytes.data(), out.bytes.size());
  return out;
}

void unpack(const fs::path& file, const fs::path& into) {
  fs::create_directories(into);
  ArchivePtr in(archive_read_new(), archive_read_free);
  archive_read_support_format_tar(in.get());
  ArchivePtr disk(archive_write_disk_new(), archive_write_free);
  // Entry names are checked below and then made absolute under `into`; libarchive refuses to
  // write through a link or to a path with "..".
  archive_write_disk_set_options(disk.get(), ARCHIVE_EXTRACT_PERM | ARCHIVE_EXTRACT_TIME |
                                                 ARCHIVE_EXTRACT_SECURE_SYMLINKS |
                                                 ARCHIVE_EXTRACT_SECURE_NODOTDOT);
  if (archive_read_open_filename(in.get(), file.c_str(), 1 << 16) != ARCHIVE_OK) {
    throw Error(fmt::format("{}: cannot open the archive: {}", file.string(),
                            archive_error_string(in.get())));
  }
  archive_entry* entry = nullptr;
  int rc;
  while ((rc = archive_read_next_header(in.get(), &entry)) == ARCHIVE_OK) {
    const std::string name = archive_entry_pathname(entry);
    if (name.empty() || name[0] == '/' || escapes(fs::path(name))) {
      throw Error(fmt::format("{}: the entry \"{}\" leads out of the working directory",
                              file.string(), name));
    }
    if (const char* link = archive_entry_symlink(entry);
        link && (link[0] == '/' || escapes(fs::path(name).parent_path() / link))) {
      throw Error(fmt::format("{}: the link \"{}\" -> \"{}\" leads out of the working directory",
                              file.string(), name, link));
    }
    const std::string target = (into / name).string();
    archive_entry_set_pathname(entry, target.c_str());
    if (archive_write_header(disk.get(), entry) != ARCHIVE_OK) {
      throw Error(fmt::format("{}: cannot unpack \"{}\": {}", file.string(), name,
                              archive_error_string(disk.get())));
    }
    const void* buf;
    size_t size;
    la_int64_t offset;
    while (archive_read_data_block(in.get(), &buf, &size, &offset) == ARCHIVE_OK)
      archive_write_data_block(disk.get(), buf, size, offset);
    archive_write_finish_entry(disk.get());
  }
  if (rc != ARCHIVE_EOF) {
    throw Error(
        fmt::format("{}: a damaged archive: {}", file.string(), archive_error_string(in.get())));
  }
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
