#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/runtime/sha256.hpp"
#include "twinkle/fd.hpp"
#include "twinkle/plugin.h"
#include "twinkle/value.hpp"

// Checkpoints on disk (docs/ARCHITECTURE.md, Checkpoints): each worker writes its part, the
// driver publishes the manifest. A checkpoint is a folder `step-NNNNNNNNNN` in the job's
// checkpoint_dir holding `manifest.json` and one part per worker; it is written as a hidden
// temporary folder and renamed into place only once every file in it is on disk, so that a
// checkpoint interrupted at any point never becomes the newest.
namespace twinkle::core::checkpoint {

inline constexpr int kFormat = 1;

// What a worker's part holds: the state of each of its instances that has state, by key
// ("driver/Mlp/0": made by the driver, the first Mlp it made on this worker).
class PartWriter {
 public:
  // Creates `file` (it must not exist) for `records` states of the checkpoint of `step`.
  PartWriter(const std::filesystem::path& file, std::uint32_t records, std::int64_t step);
  // Appends one instance's state, as the plugin's save function gave it.
  void add(const std::string& key, const std::string& cls, const twk_value_v1& state);
  struct Written {
    std::string sha256;  // hex, of the whole file
    std::uint64_t bytes = 0;
  };
  // Checks that every record came, and flushes the file to disk.
  Written finish();

 private:
  void write(const void* data, std::size_t n);
  void pad_to(std::size_t alignment);

  std::filesystem::path file_;
  std::int64_t step_;
  Fd fd_;
  Sha256 hash_;
  std::uint64_t offset_ = 0;
  std::uint32_t expected_ = 0, written_ = 0;
};

// A part read back, its checksum verified: the states as the plugin gave them, their tensors
// read-only views of the file's mapping (the plugin's load copies what it keeps).
class Part {
 public:
  // Throws Error naming the file and what is wrong with it.
  static Part read(const std::filesystem::path& file, const std::string& sha256);
  // The state stored under `key` for an instance of `cls`; nullptr when the part has none.
  // Throws Error when the key holds another class's state.
  EncodedValue* state(const std::string& key, const std::string& cls);
  std::size_t size() const { return records_.size(); }

 private:
  struct Record {
    std::string cls;
    EncodedValue value;
  };
  std::filesystem::path file_;
  std::map<std::string, Record> records_;
};

// One group of the job as a checkpoint records it, to tell whether it fits another job.
struct GroupShape {
  std::string name;
  int workers = 0;
  std::vector<std::pair<std::string, int>> mesh;  // dimension and size, outermost first
};

// One worker's part, as the manifest lists it.
struct PartEntry {
  std::string worker;  // "model:1"
  std::string file;    // its name in the checkpoint's folder
  std::string sha256;
  std::uint64_t bytes = 0;
  std::uint64_t instances = 0;
};

struct Manifest {
  int format = kFormat;
  std::uint64_t seq = 0;  // 1 + the newest one's when it was published: newest is highest
  std::int64_t step = 0;
  Value meta = Value::map();
  std::string job, run_id, created;  // created: UTC, ISO 8601
  std::vector<GroupShape> groups;
  std::vector<PartEntry> parts;
};

// A published checkpoint.
struct Found {
  std::filesystem::path dir;
  Manifest manifest;
};

// Throws Error when `meta` holds what a manifest cannot keep (tensors, bytes).
void check_meta(const Value& meta);

// The groups of `job` as a checkpoint records them.
std::vector<GroupShape> shapes_of(const Job& job);
// What differs between the checkpoint's groups and the job's, one line each; empty: it fits.
std::vector<std::string> differences(const std::vector<GroupShape>& saved,
                                     const std::vector<GroupShape>& job);

// The name of a worker's part: "model.rank1.part".
std::string part_name(const std::string& group, int index);

// Every published checkpoint under `root` whose manifest reads, newest first. Folders that are
// not checkpoints, and temporary folders of checkpoints being written, are skipped.
std::vector<Found> list(const std::filesystem::path& root);
std::optional<Found> newest(const std::filesystem::path& root);

// The hidden folder where the checkpoint of `step` is written before it is published; removes
// what killed writers left behind first. Creates `root` when it does not exist.
std::filesystem::path begin(const std::filesystem::path& root, std::int64_t step,
                            const std::string& run_id);
// Writes the manifest into `tmp` and publishes it as `root`/step-NNNNNNNNNN (replacing one of the
// same step atomically), then removes all but the newest `keep`. Returns the published folder.
// `m.seq` is set here.
std::filesystem::path publish(const std::filesystem::path& root, const std::filesystem::path& tmp,
                              Manifest m, int keep);

// Tests only: TWINKLE_TEST_CHECKPOINT_FAULT=POINT@STEP names a point of writing the checkpoint of
// STEP where the process SIGKILLs itself: "worker-part" (a worker, half way through its part),
// "driver-parts" (every part written, no manifest), "driver-manifest" (the manifest written, not
// published), "driver-published" (published, older ones not removed yet).
void fault_point(const char* name, std::int64_t step);

}  // namespace twinkle::core::checkpoint
