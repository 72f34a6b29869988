#include "plugins/loader.hpp"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::plugins {

const MethodInfo* ClassInfo::find_method(std::string_view n) const {
  for (const auto& m : methods) {
    if (m.name == n) return &m;
  }
  return nullptr;
}

namespace {

// The load-check child's exit code when it cannot report to its parent.
constexpr int kLostParentExit = 125;

// The table fields every version-1 host needs, up to and including n_drivers.
constexpr std::size_t kMinPluginTable = offsetof(twk_plugin_v1, n_drivers) + sizeof(std::uint32_t);
constexpr std::size_t kMinMethod = offsetof(twk_method_v1, invoke) + sizeof(twk_invoke_fn);
constexpr std::size_t kMinClass = offsetof(twk_class_v1, n_methods) + sizeof(std::uint32_t);
// A table entry larger than this is no table this ABI describes (entries grow a few fields at a
// time); the stride of an array is its entries' own size, so it must be believable.
constexpr std::uint32_t kMaxEntrySize = 1024;
constexpr std::int32_t kMaxRetries = 100;  // twinkle::retry

#if defined(__x86_64__)
constexpr int kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr int kHostMachine = EM_AARCH64;
#else
constexpr int kHostMachine = -1;
#endif

std::string machine_name(int m) {
  switch (m) {
    case EM_X86_64: return "x86-64";
    case EM_AARCH64: return "aarch64";
    case EM_386: return "i386";
    case EM_ARM: return "arm";
    case EM_RISCV: return "riscv";
    case EM_PPC64: return "ppc64";
    default: return fmt::format("machine {}", m);
  }
}

std::string file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

std::uint64_t get_le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(p[i]) << (8 * i);
  return v;
}

// offset + count * entry <= limit, without overflow.
bool table_fits(std::uint64_t offset, std::uint64_t count, std::uint64_t entry,
                std::uint64_t limit) {
  if (offset > limit) return false;
  if (entry != 0 && count > (limit - offset) / entry) return false;
  return true;
}

std::string truncated(const std::string& p, std::uint64_t size, std::uint64_t need) {
  return fmt::format(
      "{}: the file is truncated ({} bytes, its ELF headers need {}); rebuild the plugin", p, size,
      need);
}

}  // namespace

void check_elf_image(const unsigned char* h, std::size_t head_size, std::uint64_t file_size,
                     const std::string& p) {
  if (head_size < SELFMAG || std::memcmp(h, ELFMAG, SELFMAG) != 0) {
    throw PluginError(
        fmt::format("{}: not a shared library (no ELF header); build the plugin as a .so", p));
  }
  if (head_size < EI_NIDENT || h[EI_CLASS] != ELFCLASS64) {
    if (head_size > EI_CLASS && h[EI_CLASS] == ELFCLASS32) {
      throw PluginError(
          fmt::format("{}: a 32-bit ELF file; rebuild the plugin as 64-bit for this machine", p));
    }
    if (head_size < sizeof(Elf64_Ehdr)) throw PluginError(truncated(p, file_size, 64));
    throw PluginError(fmt::format("{}: an ELF file of unknown class; rebuild the plugin", p));
  }
  if (head_size < sizeof(Elf64_Ehdr)) throw PluginError(truncated(p, file_size, 64));
  if (h[EI_DATA] == ELFDATA2MSB) {
    throw PluginError(fmt::format("{}: a big-endian ELF file; rebuild the plugin here", p));
  }
  const int type = static_cast<int>(get_le(h + offsetof(Elf64_Ehdr, e_type), 2));
  const int machine = static_cast<int>(get_le(h + offsetof(Elf64_Ehdr, e_machine), 2));
  if (kHostMachine >= 0 && machine != kHostMachine) {
    throw PluginError(fmt::format("{}: built for {}, this machine is {}; rebuild the plugin here",
                                  p, machine_name(machine), machine_name(kHostMachine)));
  }
  if (type != ET_DYN) {
    throw PluginError(fmt::format(
        "{}: an ELF {} rather than a shared object; build it with shared_module()/-shared", p,
        type == ET_EXEC  ? "executable"
        : type == ET_REL ? "object file"
                         : "file"));
  }
  const std::uint64_t phoff = get_le(h + offsetof(Elf64_Ehdr, e_phoff), 8);
  const std::uint64_t phentsize = get_le(h + offsetof(Elf64_Ehdr, e_phentsize), 2);
  const std::uint64_t phnum = get_le(h + offsetof(Elf64_Ehdr, e_phnum), 2);
  const std::uint64_t shoff = get_le(h + offsetof(Elf64_Ehdr, e_shoff), 8);
  const std::uint64_t shentsize = get_le(h + offsetof(Elf64_Ehdr, e_shentsize), 2);
  const std::uint64_t shnum = get_le(h + offsetof(Elf64_Ehdr, e_shnum), 2);
  if (phnum == 0 || phentsize < sizeof(Elf64_Phdr)) {
    throw PluginError(fmt::format("{}: a malformed ELF file (no program headers); rebuild it", p));
  }
  if (!table_fits(phoff, phnum, phentsize, file_size) ||
      (shoff != 0 && !table_fits(shoff, shnum, shentsize, file_size))) {
    const std::uint64_t need =
        std::max(table_fits(phoff, phnum, phentsize, UINT64_MAX) ? phoff + phnum * phentsize : 0,
                 table_fits(shoff, shnum, shentsize, UINT64_MAX) ? shoff + shnum * shentsize : 0);
    throw PluginError(truncated(p, file_size, need));
  }
  if (!table_fits(phoff, phnum, phentsize, head_size)) {
    throw PluginError(fmt::format(
        "{}: a malformed ELF file (program headers at offset {}); rebuild it", p, phoff));
  }
  bool loads = false;
  for (std::uint64_t i = 0; i < phnum; ++i) {
    const unsigned char* ph = h + phoff + i * phentsize;
    if (get_le(ph + offsetof(Elf64_Phdr, p_type), 4) != PT_LOAD) continue;
    loads = true;
    const std::uint64_t off = get_le(ph + offsetof(Elf64_Phdr, p_offset), 8);
    const std::uint64_t filesz = get_le(ph + offsetof(Elf64_Phdr, p_filesz), 8);
    if (!table_fits(off, 1, filesz, file_size)) {
      throw PluginError(truncated(p, file_size, off > UINT64_MAX - filesz ? off : off + filesz));
    }
  }
  if (!loads) {
    throw PluginError(fmt::format("{}: a malformed ELF file (nothing to load); rebuild it", p));
  }
}

void check_plugin_file(const std::filesystem::path& path) {
  const std::string p = path.string();
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  const Fd fd(::open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd) {
    const int e = errno;
    if (e == ENOENT || e == ENOTDIR) {
      throw PluginError(
          fmt::format("{}: no such plugin file; build the plugin or fix job.plugin", p));
    }
    throw PluginError(fmt::format("{}: cannot open the plugin: {}", p, std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    throw PluginError(fmt::format("{}: cannot stat the plugin: {}", p, std::strerror(errno)));
  }
  if (S_ISDIR(st.st_mode)) {
    throw PluginError(
        fmt::format("{}: is a directory; job.plugin must name the plugin's .so file", p));
  }
  if (!S_ISREG(st.st_mode)) {
    throw PluginError(
        fmt::format("{}: is {}, not a regular file; job.plugin must name the plugin's .so file", p,
                    file_kind(st.st_mode)));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > kMaxPluginBytes) {
    throw PluginError(fmt::format("{}: the file is {} bytes, more than the {} a plugin may have", p,
                                  size, kMaxPluginBytes));
  }
  std::vector<unsigned char> head(std::min<std::uint64_t>(size, 64 * 1024));
  std::size_t got = 0;
  while (got < head.size()) {
    const ssize_t n =
        ::pread(fd.get(), head.data() + got, head.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  check_elf_image(head.data(), got, size, p);
}

namespace {

template <class T>
bool has_field(std::uint32_t size, std::size_t offset) {
  return size >= offset + sizeof(T);
}

Dispatch to_dispatch(std::int32_t v, const std::string& where) {
  if (v < TWK_DISPATCH_ALL || v > TWK_DISPATCH_CUSTOM) {
    throw PluginError(fmt::format(
        "{}: dispatch value {} is unknown (known: 0 all, 1 slice, 2 slice_dp, 3 custom); "
        "rebuild the plugin against this twinkle's SDK",
        where, v));
  }
  return static_cast<Dispatch>(v);
}

Execute to_execute(std::int32_t v, const std::string& where, bool allow_class) {
  if (v < TWK_EXECUTE_ALL || v > (allow_class ? TWK_EXECUTE_CLASS : TWK_EXECUTE_PEER)) {
    throw PluginError(
        fmt::format("{}: execute value {} is unknown (known: 0 all, 1 first, 2 peer{}); "
                    "rebuild the plugin against this twinkle's SDK",
                    where, v, allow_class ? ", 3 as the class" : ""));
  }
  return v == TWK_EXECUTE_CLASS ? Execute::all : static_cast<Execute>(v);
}

Collect to_collect(std::int32_t v, const std::string& where) {
  if (v < TWK_COLLECT_NONE || v > TWK_COLLECT_CUSTOM) {
    throw PluginError(fmt::format(
        "{}: collect value {} is unknown (known: 0 none, 1 mean, 2 sum, 3 first, "
        "4 last_pp, 5 flatten, 6 custom); rebuild the plugin against this twinkle's SDK",
        where, v));
  }
  return static_cast<Collect>(v);
}

std::string name_or_fail(const char* n, const std::string& what) {
  if (!n || !*n) throw PluginError(fmt::format("{} has no name", what));
  const std::size_t len = strnlen(n, kMaxNameBytes + 1);
  if (len > kMaxNameBytes) {
    throw PluginError(fmt::format("{}: its name is longer than {} bytes; the table is corrupt",
                                  what, kMaxNameBytes));
  }
  return std::string(n, len);
}

void check_count(std::uint32_t n, const std::string& what) {
  if (n > kMaxTableEntries) {
    throw PluginError(fmt::format("{} {}, more than the {} a table may hold; the table is corrupt",
                                  what, n, kMaxTableEntries));
  }
}

// Whether `addr` lies in an executable segment of a loaded object: a function pointer of the table
// that does not is garbage, and calling it later would crash a worker far from the cause.
bool is_code(const void* addr) {
  struct Probe {
    std::uintptr_t addr;
    bool found;
  } probe{reinterpret_cast<std::uintptr_t>(addr), false};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* pr = static_cast<Probe*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const auto& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_X)) continue;
          const std::uintptr_t begin = info->dlpi_addr + ph.p_vaddr;
          if (pr->addr >= begin && pr->addr - begin < ph.p_memsz) {
            pr->found = true;
            return 1;
          }
        }
        return 0;
      },
      &probe);
  return probe.found;
}

template <class Fn>
Fn code_or_fail(Fn fn, const std::string& what) {
  if (fn && !is_code(reinterpret_cast<const void*>(fn))) {
    throw PluginError(fmt::format(
        "{} points outside the plugin's code (a garbage pointer); the table is corrupt", what));
  }
  return fn;
}

template <class Fn, class Entry>
std::vector<NamedFn<Fn>> read_named(const Entry* entries, std::uint32_t n, const std::string& file,
                                    const char* kind) {
  std::vector<NamedFn<Fn>> out;
  std::set<std::string> seen;
  check_count(n, fmt::format("{}: the table lists", file));
  if (n && !entries)
    throw PluginError(fmt::format("{}: the table lists {} {}s but no array", file, n, kind));
  for (std::uint32_t i = 0; i < n; ++i) {
    std::string name = name_or_fail(entries[i].name, fmt::format("{}: {} {}", file, kind, i));
    if (!seen.insert(name).second) {
      throw PluginError(fmt::format("{}: {} \"{}\" is declared twice; give each a unique name",
                                    file, kind, name));
    }
    if (!entries[i].fn)
      throw PluginError(fmt::format("{}: {} \"{}\" has no function", file, kind, name));
    out.push_back(
        {name, code_or_fail(entries[i].fn, fmt::format("{}: {} \"{}\"", file, kind, name))});
  }
  return out;
}

// The plugin's entry function: the exported symbol, checked to be a function in its code.
twk_entry_v1_fn entry_of(void* handle, const std::string& file) {
  dlerror();
  void* sym = dlsym(handle, TWK_ENTRY_SYMBOL);
  if (!sym) {
    throw PluginError(fmt::format(
        "{}: no symbol {}; add TWINKLE_PLUGIN(\"name\", \"version\") to one source file of the "
        "plugin "
        "(or export extern \"C\" const twk_plugin_v1* {}(void) with default visibility)",
        file, TWK_ENTRY_SYMBOL, TWK_ENTRY_SYMBOL));
  }
  void* sym_extra = nullptr;
  Dl_info dl_info{};
  const bool have_info = dladdr1(sym, &dl_info, &sym_extra, RTLD_DL_SYMENT) != 0;
  const auto* sym_info = static_cast<const ElfW(Sym)*>(sym_extra);
  if (have_info && sym_info && ELF64_ST_TYPE(sym_info->st_info) != STT_FUNC &&
      ELF64_ST_TYPE(sym_info->st_info) != STT_GNU_IFUNC) {
    throw PluginError(fmt::format(
        "{}: {} is data, not a function; export it as extern \"C\" const twk_plugin_v1* {}(void) "
        "(TWINKLE_PLUGIN does)",
        file, TWK_ENTRY_SYMBOL, TWK_ENTRY_SYMBOL));
  }
  if (!is_code(sym)) {
    throw PluginError(fmt::format("{}: {} is not in the plugin's code; rebuild the plugin", file,
                                  TWK_ENTRY_SYMBOL));
  }
  return reinterpret_cast<twk_entry_v1_fn>(sym);
}

// Entry `i` of an array of tables whose stride is the size the plugin was built with (tables
// grow at their end, so a plugin built with an older or newer SDK has entries of another size
// than this twinkle's struct). No entry may claim more than that stride (its fields would reach
// into the next); one that claims too little for a table is refused by its reader.
template <class T>
const T& entry_at(const T* array, std::uint32_t i, const std::string& what) {
  const std::uint32_t stride = array[0].size;
  if (stride < sizeof(std::uint32_t) || stride > kMaxEntrySize) {
    throw PluginError(
        fmt::format("{} table is {} bytes; that is no table of this ABI (rebuild the "
                    "plugin against this twinkle's SDK)",
                    what, stride));
  }
  const T& e =
      *reinterpret_cast<const T*>(reinterpret_cast<const char*>(array) + std::size_t{stride} * i);
  if (e.size > stride) {
    throw PluginError(
        fmt::format("{} {} table is {} bytes, the first one {}; the entries of one "
                    "array have one size",
                    what, i, e.size, stride));
  }
  return e;
}

// Method `j` of class `ci` (its execute, for methods that take the class's).
MethodInfo read_method(const twk_method_v1& m, std::uint32_t j, const ClassInfo& ci,
                       const std::string& file) {
  const std::string cw = fmt::format("{}: class {}", file, ci.name);
  if (m.size < kMinMethod) {
    throw PluginError(
        fmt::format("{}: method {} table is {} bytes, smaller than {}", cw, j, m.size, kMinMethod));
  }
  MethodInfo mi;
  mi.name = name_or_fail(m.name, fmt::format("{}: method {}", cw, j));
  const std::string mw = fmt::format("{}: class {} method {}", file, ci.name, mi.name);
  mi.dispatch = to_dispatch(m.dispatch, mw);
  mi.execute_from_class = m.execute == TWK_EXECUTE_CLASS;
  mi.execute = mi.execute_from_class ? ci.execute : to_execute(m.execute, mw, true);
  mi.collect = to_collect(m.collect, mw);
  if (!(m.timeout_s >= 0 && m.timeout_s <= kMaxMethodTimeoutS)) {
    throw PluginError(fmt::format("{}: timeout {} must be between 0 and {:g} seconds", mw,
                                  m.timeout_s, kMaxMethodTimeoutS));
  }
  mi.timeout_s = m.timeout_s;
  if (mi.dispatch == Dispatch::custom) {
    if (!m.custom_dispatch)
      throw PluginError(fmt::format("{}: custom dispatch names no function", mw));
    mi.custom_dispatch = name_or_fail(m.custom_dispatch, mw + ": custom dispatch");
  }
  if (mi.collect == Collect::custom) {
    if (!m.custom_collect)
      throw PluginError(fmt::format("{}: custom collect names no function", mw));
    mi.custom_collect = name_or_fail(m.custom_collect, mw + ": custom collect");
  }
  if (!m.invoke) throw PluginError(fmt::format("{} has no invoke function", mw));
  mi.invoke = code_or_fail(m.invoke, mw + " invoke function");
  if (has_field<std::int32_t>(m.size, offsetof(twk_method_v1, retries))) {
    if (m.retries < 0 || m.retries > kMaxRetries) {
      throw PluginError(fmt::format("{}: retry {} must be 0 to {}", mw, m.retries, kMaxRetries));
    }
    mi.retries = m.retries;
  }
  return mi;
}

// Class `i` of the table with its methods.
ClassInfo read_class(const twk_class_v1& c, std::uint32_t i, const std::string& file) {
  if (c.size < kMinClass) {
    throw PluginError(
        fmt::format("{}: class {} table is {} bytes, smaller than {}", file, i, c.size, kMinClass));
  }
  ClassInfo ci;
  ci.name = name_or_fail(c.name, fmt::format("{}: class {}", file, i));
  const std::string cw = fmt::format("{}: class {}", file, ci.name);
  ci.execute = to_execute(c.execute, cw, false);
  if (!c.construct || !c.destruct) {
    throw PluginError(
        fmt::format("{} has no constructor or destructor; declare it with TWINKLE_CLASS", cw));
  }
  ci.construct = code_or_fail(c.construct, cw + " constructor");
  ci.destruct = code_or_fail(c.destruct, cw + " destructor");
  check_count(c.n_methods, cw + " lists methods:");
  if (c.n_methods && !c.methods)
    throw PluginError(fmt::format("{} lists methods but no array", cw));
  if (has_field<twk_load_fn>(c.size, offsetof(twk_class_v1, load)) && (c.save || c.load)) {
    if (!c.save || !c.load) {
      throw PluginError(fmt::format(
          "{} has a save function but no load function, or the reverse; declare both with "
          "TWINKLE_STATE",
          cw));
    }
    ci.save = code_or_fail(c.save, cw + " save function");
    ci.load = code_or_fail(c.load, cw + " load function");
  }
  std::set<std::string> method_names;
  for (std::uint32_t j = 0; j < c.n_methods; ++j) {
    MethodInfo mi = read_method(entry_at(c.methods, j, cw + " method"), j, ci, file);
    if (!method_names.insert(mi.name).second) {
      throw PluginError(
          fmt::format("{}: class {} method {} is declared twice; give each method of a class a "
                      "unique name",
                      file, ci.name, mi.name));
    }
    ci.methods.push_back(std::move(mi));
  }
  return ci;
}

// The table's header: a known ABI version and a size that covers what that version requires.
void check_header(const twk_plugin_v1* t, const std::string& file) {
  if (!t) throw PluginError(fmt::format("{}: {}() returned no table", file, TWK_ENTRY_SYMBOL));
  if (t->abi_version != TWK_ABI_VERSION) {
    throw PluginError(
        fmt::format("{}: plugin ABI version {} is not known to this twinkle (it knows {}); rebuild "
                    "the plugin against this "
                    "twinkle's SDK",
                    file, t->abi_version, TWK_ABI_VERSION));
  }
  if (t->size < kMinPluginTable) {
    throw PluginError(
        fmt::format("{}: plugin table is {} bytes, smaller than the {} bytes ABI {} requires; the "
                    "table is corrupt or was built by a broken SDK",
                    file, t->size, kMinPluginTable, TWK_ABI_VERSION));
  }
}

}  // namespace

Plugin Plugin::load(const std::filesystem::path& path) { return load_reporting(path, -1); }

Plugin Plugin::load_reporting(const std::filesystem::path& path, int report_fd) {
  auto report = [report_fd](Stage s) {
    const char c = static_cast<char>(s);
    if (report_fd >= 0 && ::write(report_fd, &c, 1) != 1) _exit(kLostParentExit);
  };
  check_plugin_file(path);
  const std::string file = path.string();
  Plugin p;
  p.path_ = path;
  // A path without a slash would make dlopen search the library path instead of this file.
  const std::string open_path = path.has_parent_path() ? file : "./" + file;
  report(Stage::opening);
  p.handle_ = dlopen(open_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!p.handle_) {
    const char* err = dlerror();
    throw PluginError(
        fmt::format("{}: cannot be loaded: {}", file, err ? err : "unknown dlopen error"));
  }
  const twk_entry_v1_fn entry = entry_of(p.handle_, file);
  report(Stage::entry);
  const twk_plugin_v1* t = entry();
  report(Stage::table);
  check_header(t, file);
  p.abi_version_ = t->abi_version;
  p.name_ = name_or_fail(t->name, fmt::format("{}: the plugin", file));
  p.version_ = t->version ? std::string(t->version, strnlen(t->version, kMaxNameBytes)) : "";

  check_count(t->n_classes, fmt::format("{}: the table lists classes:", file));
  if (t->n_classes && !t->classes)
    throw PluginError(fmt::format("{}: the table lists classes but no array", file));
  std::set<std::string> class_names;
  for (std::uint32_t i = 0; i < t->n_classes; ++i) {
    ClassInfo ci = read_class(entry_at(t->classes, i, file + ": class"), i, file);
    if (!class_names.insert(ci.name).second) {
      throw PluginError(fmt::format("{}: class {} is declared twice; give each class a unique name",
                                    file, ci.name));
    }
    p.classes_.push_back(std::move(ci));
  }
  p.drivers_ = read_named<twk_driver_fn>(t->drivers, t->n_drivers, file, "driver entry");
  if (has_field<std::uint32_t>(t->size, offsetof(twk_plugin_v1, n_dispatchers))) {
    p.dispatchers_ =
        read_named<twk_dispatch_fn>(t->dispatchers, t->n_dispatchers, file, "dispatcher");
  }
  if (has_field<std::uint32_t>(t->size, offsetof(twk_plugin_v1, n_collectors))) {
    p.collectors_ = read_named<twk_collect_fn>(t->collectors, t->n_collectors, file, "collector");
  }
  p.check_custom_functions();
  return p;
}

void Plugin::check_custom_functions() const {
  const std::string file = path_.string();
  for (const auto& c : classes_) {
    for (const auto& m : c.methods) {
      if (!m.custom_dispatch.empty() && !find_dispatcher(m.custom_dispatch)) {
        throw PluginError(fmt::format(
            "{}: class {} method {}: custom dispatch \"{}\" is not registered; declare it "
            "with TWINKLE_DISPATCHER",
            file, c.name, m.name, m.custom_dispatch));
      }
      if (!m.custom_collect.empty() && !find_collector(m.custom_collect)) {
        throw PluginError(fmt::format(
            "{}: class {} method {}: custom collect \"{}\" is not registered; declare it "
            "with TWINKLE_COLLECTOR",
            file, c.name, m.name, m.custom_collect));
      }
    }
  }
}

namespace {

std::string signal_text(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

// What went wrong in a load-check child that did not report an error itself.
std::string child_failure(const std::string& file, char stage, int status, bool timed_out,
                          double timeout_s) {
  std::string who;
  switch (stage) {
    case 'o': who = "the plugin's constructor"; break;
    case 'e': who = fmt::format("{}()", TWK_ENTRY_SYMBOL); break;
    case 't': who = "reading the plugin's table"; break;
    default: who = "checking the plugin"; break;
  }
  if (timed_out) {
    return fmt::format(
        "{}: {} did not finish loading within {:g} s; a plugin's constructors and {}() must return "
        "(TWINKLE_PLUGIN_LOAD_TIMEOUT_S sets the limit)",
        file, stage == 't' ? "the plugin" : who, timeout_s, TWK_ENTRY_SYMBOL);
  }
  if (WIFEXITED(status)) {
    return fmt::format("{}: {} called exit({}) while loading; a plugin must not end the process",
                       file, stage == 't' ? "the plugin" : who, WEXITSTATUS(status));
  }
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  if (sig == SIGBUS && stage == 'o') {
    return fmt::format(
        "{}: loading was killed by SIGBUS: the file is truncated or changed while loading; "
        "rebuild the plugin",
        file);
  }
  if (stage == 't') {
    return fmt::format(
        "{}: reading the plugin's table was killed by {}: the table has garbage pointers or "
        "counts; rebuild the plugin against this twinkle's SDK",
        file, signal_text(sig));
  }
  if (sig == SIGABRT) return fmt::format("{}: {} aborted (SIGABRT) while loading", file, who);
  return fmt::format("{}: {} was killed by {} while loading", file, who, signal_text(sig));
}

}  // namespace

void Plugin::check_in_child(const std::filesystem::path& path, std::chrono::milliseconds timeout) {
  const std::string file = path.string();
  // The cheap checks here: a missing file, a FIFO or a non-ELF file need no child.
  check_plugin_file(path);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throw PluginError(
        fmt::format("{}: cannot check the plugin: pipe: {}", file, std::strerror(errno)));
  }
  Fd from_child(fds[0]);
  Fd to_parent(fds[1]);
  std::fflush(nullptr);  // the child's exit() must not write our buffered output twice
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    throw PluginError(fmt::format("{}: cannot check the plugin: fork: {}", file, std::strerror(e)));
  }
  if (pid == 0) {
    // The child ends in _exit(), which runs no destructor: what it must close, it closes here.
    from_child.reset();
    ::setpgid(0, 0);  // its own group, so that anything the plugin starts is killed with it
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(kLostParentExit);
    if (const Fd null(::open("/dev/null", O_RDONLY)); null) ::dup2(null.get(), STDIN_FILENO);
    std::string reply;
    int code = 0;
    try {
      Plugin p = load_reporting(path, to_parent.get());
      reply = "K";
      p.handle_ = nullptr;  // no dlclose: its destructors are the plugin's business, not ours
    } catch (const std::exception& e) {
      reply = std::string("X") + e.what();
      code = 3;
    }
    for (std::size_t at = 0; at < reply.size();) {
      const ssize_t n = ::write(to_parent.get(), reply.data() + at, reply.size() - at);
      if (n <= 0) _exit(kLostParentExit);
      at += static_cast<std::size_t>(n);
    }
    _exit(code);
  }
  to_parent.reset();    // now, so that the read end sees end of file when the child ends
  ::setpgid(pid, pid);  // also here: no race with the child's own call

  std::string got;
  int status = 0;
  bool timed_out = false;
  bool eof = false;
  // The child's exit wakes the poll below (its grandchildren may keep the pipe open, and the
  // pipe's end of file comes a little before the child can be reaped); without pidfds, a poll
  // every 20 ms notices it.
  const Fd exited = open_pidfd(pid);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd pfd[2] = {{exited.get(), POLLIN, 0}, {eof ? -1 : from_child.get(), POLLIN, 0}};
    const int wait_ms = static_cast<int>(exited ? left.count() : std::min<long>(left.count(), 20));
    if (::poll(pfd, 2, wait_ms) > 0 && (pfd[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      char buf[4096];
      const ssize_t n = ::read(from_child.get(), buf, sizeof buf);
      if (n > 0 && got.size() < (1 << 20)) got.append(buf, static_cast<std::size_t>(n));
      if (n == 0) eof = true;
    }
  }
  ::kill(-pid, SIGKILL);  // grandchildren the plugin may have started, and a hung child
  if (timed_out) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  // Whatever the child wrote before it ended.
  ::fcntl(from_child.get(), F_SETFL, O_NONBLOCK);
  for (char buf[4096];;) {
    const ssize_t n = ::read(from_child.get(), buf, sizeof buf);
    if (n <= 0 || got.size() > (1 << 20)) break;
    got.append(buf, static_cast<std::size_t>(n));
  }
  from_child.reset();

  std::size_t stages = 0;
  while (stages < got.size() && (got[stages] == 'o' || got[stages] == 'e' || got[stages] == 't'))
    ++stages;
  const char stage = stages ? got[stages - 1] : '\0';
  const std::string result = got.substr(stages);
  if (!timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0 && result == "K") return;
  if (!timed_out && !result.empty() && result[0] == 'X') throw PluginError(result.substr(1));
  throw PluginError(child_failure(file, stage, status, timed_out,
                                  std::chrono::duration<double>(timeout).count()));
}

Plugin Plugin::load_checked(const std::filesystem::path& path) {
  std::chrono::milliseconds timeout = kDefaultLoadCheckTimeout;
  if (const char* env = std::getenv("TWINKLE_PLUGIN_LOAD_TIMEOUT_S"); env && *env) {
    char* end = nullptr;
    const double s = std::strtod(env, &end);
    if (*end != '\0' || !(s > 0 && s <= 3600)) {
      throw PluginError(fmt::format(
          "TWINKLE_PLUGIN_LOAD_TIMEOUT_S={}: must be a number of seconds between 0 and 3600", env));
    }
    timeout = std::chrono::milliseconds(static_cast<long>(s * 1000));
  }
  check_in_child(path, timeout);
  return load(path);
}

Plugin::Plugin(Plugin&& o) noexcept { *this = std::move(o); }

Plugin& Plugin::operator=(Plugin&& o) noexcept {
  if (this != &o) {
    close();
    handle_ = std::exchange(o.handle_, nullptr);
    path_ = std::move(o.path_);
    name_ = std::move(o.name_);
    version_ = std::move(o.version_);
    abi_version_ = o.abi_version_;
    classes_ = std::move(o.classes_);
    drivers_ = std::move(o.drivers_);
    dispatchers_ = std::move(o.dispatchers_);
    collectors_ = std::move(o.collectors_);
  }
  return *this;
}

Plugin::~Plugin() { close(); }

void Plugin::close() noexcept {
  if (handle_) dlclose(handle_);
  handle_ = nullptr;
}

const ClassInfo* Plugin::find_class(std::string_view n) const {
  for (const auto& c : classes_) {
    if (c.name == n) return &c;
  }
  return nullptr;
}

template <class Fn>
static Fn find_named(const std::vector<NamedFn<Fn>>& v, std::string_view n) {
  for (const auto& e : v) {
    if (e.name == n) return e.fn;
  }
  return nullptr;
}

twk_driver_fn Plugin::find_driver(std::string_view n) const { return find_named(drivers_, n); }
twk_dispatch_fn Plugin::find_dispatcher(std::string_view n) const {
  return find_named(dispatchers_, n);
}
twk_collect_fn Plugin::find_collector(std::string_view n) const {
  return find_named(collectors_, n);
}

}  // namespace twinkle::plugins
