#include "core/runtime/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/job/digest.hpp"
#include "core/runtime/sha256.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::checkpoint {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kMagic[8] = {'T', 'W', 'K', 'P', 'A', 'R', 'T', '1'};
constexpr std::size_t kDataAlignment = 64;     // tensor payloads start at multiples of this
constexpr std::size_t kWriteChunk = 8u << 20;  // a part is written and written back in these
constexpr std::size_t kHashAside = 4u << 20;   // payloads from this size are hashed aside
constexpr std::int32_t kMaxDims = 64;
constexpr std::uint32_t kMaxName = 4096;

std::string errno_text() { return std::strerror(errno); }

// Flushes a folder's entries (a created or renamed file is durable only then).
void sync_dir(const fs::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd || ::fsync(fd.get()) != 0)
    throw Error(fmt::format("cannot flush the folder {} to disk: {}", dir.string(), errno_text()));
}

void write_file_synced(const fs::path& file, const std::string& text) {
  Fd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) throw Error(fmt::format("cannot create {}: {}", file.string(), errno_text()));
  std::size_t at = 0;
  while (at < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(fmt::format("cannot write {}: {}", file.string(), errno_text()));
    at += static_cast<std::size_t>(n);
  }
  if (::fsync(fd.get()) != 0)
    throw Error(fmt::format("cannot flush {} to disk: {}", file.string(), errno_text()));
}

// ----- meta: a value without tensors or bytes, as JSON -------------------------------------

json to_json(const Value& v, const std::string& path) {
  switch (v.kind()) {
    case Value::Kind::null: return nullptr;
    case Value::Kind::boolean: return v.as<bool>();
    case Value::Kind::integer: return v.as<std::int64_t>();
    case Value::Kind::floating: return v.as<double>();
    case Value::Kind::string: return v.as<std::string>();
    case Value::Kind::list: {
      json out = json::array();
      for (std::size_t i = 0; i < v.size(); ++i)
        out.push_back(to_json(v[i], fmt::format("{}[{}]", path, i)));
      return out;
    }
    case Value::Kind::map: {
      json out = json::object();
      for (const auto& [k, item] : v.map_items()) out[k] = to_json(item, path + "." + k);
      return out;
    }
    default: break;
  }
  throw Error(fmt::format(
      "checkpoint meta{}: {} values cannot be kept in a manifest; use numbers, strings, lists and "
      "maps (tensors belong in an instance's state)",
      path, v.kind_name()));
}

Value from_json(const json& j) {
  if (j.is_null()) return Value();
  if (j.is_boolean()) return Value(j.get<bool>());
  if (j.is_number_integer()) return Value(j.get<std::int64_t>());
  if (j.is_number()) return Value(j.get<double>());
  if (j.is_string()) return Value(j.get<std::string>());
  if (j.is_array()) {
    Value out = Value::list();
    for (const auto& x : j) out.push_back(from_json(x));
    return out;
  }
  Value out = Value::map();
  for (const auto& [k, x] : j.items()) out.map_items()[k] = from_json(x);
  return out;
}

json manifest_json(const Manifest& m) {
  json groups = json::array();
  for (const auto& g : m.groups) {
    json mesh = json::array();
    for (const auto& [dim, size] : g.mesh) mesh.push_back({{"dim", dim}, {"size", size}});
    groups.push_back({{"name", g.name}, {"workers", g.workers}, {"mesh", mesh}});
  }
  json parts = json::array();
  for (const auto& p : m.parts) {
    parts.push_back({{"worker", p.worker},
                     {"file", p.file},
                     {"sha256", p.sha256},
                     {"bytes", p.bytes},
                     {"instances", p.instances}});
  }
  return {{"format", m.format},          {"seq", m.seq},     {"step", m.step},
          {"meta", to_json(m.meta, "")}, {"job", m.job},     {"run_id", m.run_id},
          {"created", m.created},        {"groups", groups}, {"parts", parts}};
}

Manifest parse_manifest(const json& j) {
  Manifest m;
  m.format = j.at("format").get<int>();
  if (m.format != kFormat)
    throw Error(fmt::format("format {} (this twinkle reads {})", m.format, kFormat));
  m.seq = j.at("seq").get<std::uint64_t>();
  m.step = j.at("step").get<std::int64_t>();
  m.meta = from_json(j.at("meta"));
  m.job = j.at("job").get<std::string>();
  m.run_id = j.at("run_id").get<std::string>();
  m.created = j.at("created").get<std::string>();
  for (const auto& g : j.at("groups")) {
    GroupShape s{g.at("name").get<std::string>(), g.at("workers").get<int>(), {}};
    for (const auto& d : g.at("mesh"))
      s.mesh.emplace_back(d.at("dim").get<std::string>(), d.at("size").get<int>());
    m.groups.push_back(std::move(s));
  }
  for (const auto& p : j.at("parts")) {
    PartEntry e{p.at("worker").get<std::string>(), p.at("file").get<std::string>(),
                p.at("sha256").get<std::string>(), p.at("bytes").get<std::uint64_t>(),
                p.at("instances").get<std::uint64_t>()};
    if (e.file.empty() || e.file.find('/') != std::string::npos || e.file.front() == '.')
      throw Error(fmt::format("part \"{}\" is not a file name", e.file));
    m.parts.push_back(std::move(e));
  }
  return m;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// This host's name as temporary folders carry it (a dot would end the field).
std::string this_host() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string h = host;
  std::replace(h.begin(), h.end(), '.', '_');
  return h;
}

// ".step-12.4242@gpu1.0a1b2c3d.tmp" (or ".tmp.old"): the temporary folder of step 12 written by
// the driver of pid 4242 on host gpu1.
bool is_temporary(const std::string& name, pid_t* pid, std::string* host) {
  if (!name.starts_with(".step-") || (!name.ends_with(".tmp") && !name.ends_with(".tmp.old")))
    return false;
  const auto first = name.find('.', 6);
  const auto at = name.find('@', first);
  if (first == std::string::npos || at == std::string::npos) return false;
  *pid = static_cast<pid_t>(std::atol(name.c_str() + first + 1));
  const auto dot = name.find('.', at);
  *host = name.substr(at + 1, dot - at - 1);
  return true;
}

// A read-only mapping of a whole file, shared by the tensors that view it.
struct Mapping {
  void* data = MAP_FAILED;
  std::size_t size = 0;
  ~Mapping() {
    if (data != MAP_FAILED) ::munmap(data, size);
  }
};

// Reads a part's bytes front to back, failing on anything that runs past the end.
class Cursor {
 public:
  Cursor(const unsigned char* data, std::size_t size, const fs::path& file)
      : data_(data), size_(size), file_(file) {}
  template <class T>
  T get(const char* what) {
    T v;
    std::memcpy(&v, bytes(sizeof v, what), sizeof v);
    return v;
  }
  const unsigned char* bytes(std::size_t n, const char* what) {
    if (n > size_ - at_) {
      throw Error(fmt::format("{}: truncated at byte {} (reading {}); the part is damaged",
                              file_.string(), at_, what));
    }
    const unsigned char* p = data_ + at_;
    at_ += n;
    return p;
  }
  std::string string(const char* what) {
    const auto n = get<std::uint32_t>(what);
    if (n > kMaxName)
      throw Error(
          fmt::format("{}: a {} of {} bytes; the part is damaged", file_.string(), what, n));
    const auto* p = bytes(n, what);
    return std::string(reinterpret_cast<const char*>(p), n);
  }
  void align(std::size_t a) {
    const std::size_t pad = (a - at_ % a) % a;
    bytes(pad, "padding");
  }
  bool done() const { return at_ == size_; }

 private:
  const unsigned char* data_;
  std::size_t size_;
  std::size_t at_ = 0;
  const fs::path& file_;
};

}  // namespace

// ----- parts --------------------------------------------------------------------------------

PartWriter::PartWriter(const fs::path& file, std::uint32_t records, std::int64_t step)
    : file_(file), step_(step), expected_(records) {
  fd_ = Fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (!fd_) {
    throw Error(fmt::format("cannot create {}: {}{}", file.string(), errno_text(),
                            errno == ENOENT ? " (in remote mode, checkpoint_dir must be a folder "
                                              "every node reads and writes: a shared file system)"
                                            : ""));
  }
  write(kMagic, sizeof kMagic);
  write(&records, sizeof records);
  const std::uint32_t reserved = 0;
  write(&reserved, sizeof reserved);
}

// A large payload is hashed by a second thread while this one writes it, and written in chunks
// whose writeback starts at once, each waited for two chunks later: the page cache never holds
// more than a few chunks of it dirty, so the kernel does not throttle one huge write, and fsync
// finds little left to do.
void PartWriter::write(const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  std::jthread hasher;
  if (n >= kHashAside) {
    hasher = std::jthread([this, p, n] { hash_.update(p, n); });
  } else {
    hash_.update(p, n);
  }
  std::size_t at = 0;
  while (at < n) {
    const std::size_t chunk = std::min(n - at, kWriteChunk);
    for (std::size_t done = 0; done < chunk;) {
      const ssize_t w = ::write(fd_.get(), p + at + done, chunk - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error(fmt::format("cannot write {}: {}", file_.string(), errno_text()));
      done += static_cast<std::size_t>(w);
    }
    const auto start = static_cast<off64_t>(offset_ + at);
    if (chunk == kWriteChunk) {
      // Best effort (a file system without it just writes back later): errors come from fsync.
      ::sync_file_range(fd_.get(), start, static_cast<off64_t>(chunk), SYNC_FILE_RANGE_WRITE);
      const auto before = start - static_cast<off64_t>(2 * kWriteChunk);
      if (before >= 0) {
        ::sync_file_range(
            fd_.get(), before, static_cast<off64_t>(kWriteChunk),
            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      }
    }
    at += chunk;
  }
  offset_ += n;
}

void PartWriter::pad_to(std::size_t alignment) {
  static const char zeros[kDataAlignment] = {};
  const std::size_t pad = (alignment - offset_ % alignment) % alignment;
  if (pad) write(zeros, pad);
}

void PartWriter::add(const std::string& key, const std::string& cls, const twk_value_v1& state) {
  if (written_ == expected_)
    throw Error(fmt::format("{}: more states than the {} announced", file_.string(), expected_));
  for (const std::string* s : {&key, &cls}) {
    const auto n = static_cast<std::uint32_t>(s->size());
    write(&n, sizeof n);
    write(s->data(), s->size());
  }
  write(&state.msgpack_size, sizeof state.msgpack_size);
  write(state.msgpack, state.msgpack_size);
  fault_point("worker-part", step_);
  write(&state.n_tensors, sizeof state.n_tensors);
  for (std::uint32_t i = 0; i < state.n_tensors; ++i) {
    const twk_tensor_v1& t = state.tensors[i];
    if (!dtype_known(t.dtype) || t.ndim < 0 || t.ndim > kMaxDims || (t.ndim > 0 && !t.shape) ||
        (t.nbytes > 0 && !t.data)) {
      throw Error(
          fmt::format("state of {}: tensor {} is malformed (dtype, shape or data)", cls, i));
    }
    write(&t.dtype, sizeof t.dtype);
    write(&t.ndim, sizeof t.ndim);
    write(t.shape, sizeof(std::int64_t) * static_cast<std::size_t>(t.ndim));
    write(&t.nbytes, sizeof t.nbytes);
    pad_to(kDataAlignment);
    write(t.data, t.nbytes);
  }
  ++written_;
}

PartWriter::Written PartWriter::finish() {
  if (written_ != expected_) {
    throw Error(
        fmt::format("{}: {} of {} states were written", file_.string(), written_, expected_));
  }
  if (::fsync(fd_.get()) != 0)
    throw Error(fmt::format("cannot flush {} to disk: {}", file_.string(), errno_text()));
  fd_.reset();
  const Sha256::Digest out = hash_.finish();
  return {hex(out.data(), out.size()), offset_};
}

Part Part::read(const fs::path& file, const std::string& sha256) {
  Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw Error(fmt::format("cannot open {}: {}", file.string(), errno_text()));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode))
    throw Error(fmt::format("{} is not a regular file", file.string()));
  auto map = std::make_shared<Mapping>();
  map->size = static_cast<std::size_t>(st.st_size);
  if (map->size < sizeof kMagic + 8)
    throw Error(fmt::format("{}: {} bytes, too short for a part", file.string(), map->size));
  map->data = ::mmap(nullptr, map->size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map->data == MAP_FAILED)
    throw Error(fmt::format("cannot map {}: {}", file.string(), errno_text()));
  const auto* bytes = static_cast<const unsigned char*>(map->data);
  Sha256::Digest digest;
  try {
    digest = Sha256::of(bytes, map->size);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: cannot compute its sha256: {}", file.string(), e.what()));
  }
  if (hex(digest.data(), digest.size()) != sha256) {
    throw Error(fmt::format(
        "{}: its sha256 is not the manifest's (the file changed or was damaged after it was "
        "written)",
        file.string()));
  }
  Part part;
  part.file_ = file;
  Cursor c(bytes, map->size, part.file_);
  if (std::memcmp(c.bytes(sizeof kMagic, "the header"), kMagic, sizeof kMagic) != 0)
    throw Error(fmt::format("{} is not a checkpoint part", file.string()));
  const auto records = c.get<std::uint32_t>("the header");
  c.get<std::uint32_t>("the header");
  std::shared_ptr<const void> keep(map, map->data);
  for (std::uint32_t r = 0; r < records; ++r) {
    std::string key = c.string("key");
    Record rec;
    rec.cls = c.string("class");
    const auto msgpack_size = c.get<std::uint64_t>("a state's size");
    const auto* msgpack = c.bytes(msgpack_size, "a state");
    rec.value.msgpack.assign(reinterpret_cast<const char*>(msgpack), msgpack_size);
    const auto n_tensors = c.get<std::uint32_t>("a tensor count");
    for (std::uint32_t i = 0; i < n_tensors; ++i) {
      const auto dtype = c.get<std::int32_t>("a dtype");
      const auto ndim = c.get<std::int32_t>("a shape");
      if (!dtype_known(dtype) || ndim < 0 || ndim > kMaxDims)
        throw Error(
            fmt::format("{}: tensor {} of {} has a bad dtype or shape", file.string(), i, key));
      std::vector<std::int64_t> shape(static_cast<std::size_t>(ndim));
      std::memcpy(shape.data(), c.bytes(sizeof(std::int64_t) * shape.size(), "a shape"),
                  sizeof(std::int64_t) * shape.size());
      std::uint64_t numel = 1;
      for (const auto d : shape) {
        if (d < 0 || __builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel)) {
          throw Error(fmt::format("{}: tensor {} of {} has a bad shape", file.string(), i, key));
        }
      }
      const auto nbytes = c.get<std::uint64_t>("a tensor's size");
      std::uint64_t want = 0;
      if (__builtin_mul_overflow(numel, dtype_size(static_cast<DType>(dtype)), &want) ||
          want != nbytes) {
        throw Error(
            fmt::format("{}: tensor {} of {}: its shape needs another size than its {} "
                        "bytes",
                        file.string(), i, key, nbytes));
      }
      c.align(kDataAlignment);
      const auto* data = c.bytes(nbytes, "a tensor");
      try {
        rec.value.tensors.push_back(Tensor::view(static_cast<DType>(dtype), shape,
                                                 const_cast<unsigned char*>(data), nbytes, keep));
      } catch (const std::exception& e) {
        throw Error(fmt::format("{}: tensor {} of {}: {}", file.string(), i, key, e.what()));
      }
    }
    if (!part.records_.emplace(key, std::move(rec)).second)
      throw Error(fmt::format("{}: state {} appears twice", file.string(), key));
  }
  if (!c.done()) throw Error(fmt::format("{}: bytes after the last state", file.string()));
  return part;
}

EncodedValue* Part::state(const std::string& key, const std::string& cls) {
  auto it = records_.find(key);
  if (it == records_.end()) return nullptr;
  if (it->second.cls != cls) {
    throw Error(
        fmt::format("{}: the state of {} is a {}'s, not a {}'s (the driver creates its "
                    "instances in another order than the run that saved it)",
                    file_.string(), key, it->second.cls, cls));
  }
  return &it->second.value;
}

void check_meta(const Value& meta) { to_json(meta, ""); }

// ----- the job's shape ------------------------------------------------------------------------

std::vector<GroupShape> shapes_of(const Job& job) {
  std::vector<GroupShape> out;
  for (const auto& g : job.groups) {
    GroupShape s{g.name, g.workers(), {}};
    for (const auto& d : g.mesh.dims()) s.mesh.emplace_back(d.name, d.size);
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::string> differences(const std::vector<GroupShape>& saved,
                                     const std::vector<GroupShape>& job) {
  auto mesh_text = [](const GroupShape& g) {
    std::string out;
    for (const auto& [dim, size] : g.mesh)
      out += fmt::format("{}{}={}", out.empty() ? "" : " ", dim, size);
    return out.empty() ? std::string("none") : out;
  };
  std::vector<std::string> out;
  for (const auto& s : saved) {
    auto it = std::find_if(job.begin(), job.end(), [&](const auto& g) { return g.name == s.name; });
    if (it == job.end()) {
      out.push_back(fmt::format("group {} is in the checkpoint, not in the job", s.name));
      continue;
    }
    if (it->workers != s.workers) {
      out.push_back(fmt::format("group {} has {} workers in the checkpoint, {} in the job", s.name,
                                s.workers, it->workers));
    } else if (it->mesh != s.mesh) {
      out.push_back(fmt::format("group {} has mesh {} in the checkpoint, {} in the job", s.name,
                                mesh_text(s), mesh_text(*it)));
    }
  }
  for (const auto& g : job) {
    if (std::none_of(saved.begin(), saved.end(), [&](const auto& s) { return s.name == g.name; }))
      out.push_back(fmt::format("group {} is in the job, not in the checkpoint", g.name));
  }
  return out;
}

std::string part_name(const std::string& group, int index) {
  return fmt::format("{}.rank{}.part", group, index);
}

// ----- publishing -----------------------------------------------------------------------------

std::vector<Found> list(const fs::path& root) {
  std::vector<Found> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("step-") || !e.is_directory(ec)) continue;
    try {
      std::ifstream in(e.path() / "manifest.json");
      if (!in) continue;
      Manifest m = parse_manifest(json::parse(in));
      out.push_back(Found{e.path(), std::move(m)});
    } catch (const std::exception&) {
      // Not a checkpoint this twinkle wrote: never the newest.
    }
  }
  std::sort(out.begin(), out.end(),
            [](const Found& a, const Found& b) { return a.manifest.seq > b.manifest.seq; });
  return out;
}

std::optional<Found> newest(const fs::path& root) {
  auto all = list(root);
  if (all.empty()) return std::nullopt;
  return std::move(all.front());
}

fs::path begin(const fs::path& root, std::int64_t step, const std::string& run_id) {
  if (step < 0)
    throw Error(fmt::format("checkpoint: step {} is negative; steps count from 0", step));
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec || !fs::is_directory(root)) {
    throw Error(fmt::format("checkpoint: cannot create the folder {}: {}; fix job.checkpoint_dir",
                            root.string(), ec ? ec.message() : "not a folder"));
  }
  // What a writer killed while writing left behind: its driver, on this host, is gone.
  const std::string host = this_host();
  for (const auto& e : fs::directory_iterator(root, ec)) {
    pid_t pid = 0;
    std::string writer_host;
    if (!is_temporary(e.path().filename().string(), &pid, &writer_host)) continue;
    if (writer_host != host || pid <= 0 || pid == getpid() || ::kill(pid, 0) == 0 || errno != ESRCH)
      continue;
    const std::string name = e.path().filename().string();
    if (name.ends_with(".tmp.old")) {
      // A replaced checkpoint moved aside (no RENAME_EXCHANGE) whose writer died before the new
      // one was in place: it goes back.
      const fs::path back = root / fmt::format("step-{:010}", std::atoll(name.c_str() + 6));
      if (!fs::exists(back, ec) && ::rename(e.path().c_str(), back.c_str()) == 0) continue;
    }
    fs::remove_all(e.path(), ec);
  }
  const fs::path tmp = root / fmt::format(".step-{}.{}@{}.{}.tmp", step, getpid(), host, run_id);
  fs::remove_all(tmp, ec);
  if (::mkdir(tmp.c_str(), 0755) != 0) {
    throw Error(fmt::format("checkpoint: cannot create {}: {}", tmp.string(), errno_text()));
  }
  return tmp;
}

fs::path publish(const fs::path& root, const fs::path& tmp, Manifest m, int keep) {
  const auto before = list(root);
  m.seq = before.empty() ? 1 : before.front().manifest.seq + 1;
  if (m.created.empty()) m.created = utc_now();
  fault_point("driver-parts", m.step);
  write_file_synced(tmp / "manifest.json", manifest_json(m).dump(2) + "\n");
  sync_dir(tmp);
  fault_point("driver-manifest", m.step);
  const fs::path final_dir = root / fmt::format("step-{:010}", m.step);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    // The same step again (a resumed run saving its first step once more): swap in one step,
    // or, where the file system cannot (NFS), move the old one aside first: in between, the
    // newest is the one before it, still complete.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fs::remove_all(tmp, ec);
    } else if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
      const fs::path old = tmp.string() + ".old";
      if (::rename(final_dir.c_str(), old.c_str()) != 0) {
        throw Error(
            fmt::format("checkpoint: cannot replace {}: {}", final_dir.string(), errno_text()));
      }
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
        const std::string why = errno_text();
        ::rename(old.c_str(), final_dir.c_str());  // the old one back: it was the newest
        throw Error(fmt::format("checkpoint: cannot replace {}: {}", final_dir.string(), why));
      }
      fs::remove_all(old, ec);
    } else {
      throw Error(
          fmt::format("checkpoint: cannot replace {}: {}", final_dir.string(), errno_text()));
    }
  } else if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    throw Error(fmt::format("checkpoint: cannot publish {}: {}", final_dir.string(), errno_text()));
  }
  sync_dir(root);
  fault_point("driver-published", m.step);
  const auto all = list(root);
  for (std::size_t i = static_cast<std::size_t>(keep); i < all.size(); ++i)
    fs::remove_all(all[i].dir, ec);
  return final_dir;
}

void fault_point(const char* name, std::int64_t step) {
  const char* f = std::getenv("TWINKLE_TEST_CHECKPOINT_FAULT");
  if (f && fmt::format("{}@{}", name, step) == f) ::raise(SIGKILL);
}

}  // namespace twinkle::core::checkpoint
