// The archive module (libtwinkle_archive.so): libarchive's tar writer and reader, loaded by a
// process's first pack or unpack (core/jobs/archive.hpp). Errors become messages at the module's
// edge: no exception crosses it.
#include <archive.h>
#include <archive_entry.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <memory>

#include <fmt/format.h>

#include "core/jobs/archive.hpp"
#include "twinkle/errors.hpp"

namespace {

namespace fs = std::filesystem;
using twinkle::Error;

using ArchivePtr = std::unique_ptr<archive, int (*)(archive*)>;

// True when `rel`, normalised, climbs above its start.
bool escapes(const fs::path& rel) {
  const fs::path n = rel.lexically_normal();
  return !n.empty() && *n.begin() == "..";
}

void pack_names(const fs::path& dir, const std::vector<std::string>& names,
                std::vector<std::uint8_t>* out) {
  ArchivePtr a(archive_write_new(), archive_write_free);
  archive_write_set_format_pax_restricted(a.get());
  archive_write_set_bytes_in_last_block(a.get(), 1);
  struct Sink {
    std::vector<std::uint8_t>* bytes;
  } sink{out};
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
  for (const auto& rel : names) {
    const fs::path full = dir / rel;
    struct stat st {};
    if (lstat(full.c_str(), &st) != 0) continue;  // gone since it was listed
    std::unique_ptr<archive_entry, void (*)(archive_entry*)> entry(archive_entry_new(),
                                                                   archive_entry_free);
    archive_entry_set_pathname(entry.get(), rel.c_str());
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
}

void unpack_into(const fs::path& file, const fs::path& into) {
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

int pack(const fs::path& dir, const std::vector<std::string>& names, std::vector<std::uint8_t>* out,
         std::string* error) {
  try {
    pack_names(dir, names, out);
    return 0;
  } catch (const std::exception& e) {
    *error = e.what();
    return 1;
  }
}

int unpack(const fs::path& file, const fs::path& into, std::string* error) {
  try {
    unpack_into(file, into);
    return 0;
  } catch (const std::exception& e) {
    *error = e.what();
    return 1;
  }
}

constexpr twinkle::core::jobs::ArchiveOps kOps{pack, unpack};

}  // namespace

extern "C" __attribute__((visibility("default"))) const twinkle::core::jobs::ArchiveOps*
twinkle_archive_ops_v1() {
  return &kOps;
}
