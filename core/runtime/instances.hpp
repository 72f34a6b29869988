#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/runtime/checkpoint.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/protocol.hpp"
#include "twinkle/plugin.h"
#include "twinkle/value.hpp"

// The plugin's instances on one worker (docs/ARCHITECTURE.md, Checkpoints and Restarts): made by
// `create`, called by `call`, their state written to a checkpoint part, handed to a replacement,
// and loaded from a donor or from the checkpoint a run resumes from. Used from the worker's thread
// only.
namespace twinkle::core {

// A received value shared with the plugin without a copy (twk_value_v1 retain/release): `view`
// borrows from `hold`, and the plugin may keep it past the call instead of copying.
struct SharedArgs;
struct Shared {
  std::unique_ptr<SharedArgs, void (*)(SharedArgs*)> hold;
  twk_value_v1 view;
};
Shared share(EncodedValue v);

class Instances {
 public:
  // The plugin context of one call on this worker (rank, mesh, args, its HostOps).
  using Context = std::function<twk_context_v1()>;
  // Copies a value out of the plugin's memory into what goes on the wire (shared memory for a
  // local receiver).
  using Adopt = std::function<EncodedValue(const twk_value_v1&)>;

  // `plugin` and `host` outlive this object.
  Instances(const plugins::Plugin& plugin, twk_host_v1& host, Context context)
      : plugin_(plugin), host_(host), context_(std::move(context)) {}
  Instances(const Instances&) = delete;
  Instances& operator=(const Instances&) = delete;

  // A resumed run: the instances made from now on take their state from `part` (checkpoint of
  // `step`); with `error` (the part could not be read) the first one with state fails with it.
  void resume_from(std::int64_t step, std::optional<checkpoint::Part> part, std::string error);

  // Constructs instance `id` (the caller's handle) for `from` (empty: the driver) and, in a
  // resumed run, gives it its state from the checkpoint.
  transport::proto::Created create(transport::proto::Create& m, std::uint64_t id,
                                   const std::string& from);
  // Runs a method; `adopt` copies its result out of the plugin's memory.
  transport::proto::Reply call(transport::proto::Call& m, const Adopt& adopt);
  // Writes this worker's part of a checkpoint: the state of every instance that has state, in
  // the order they were made, straight from the plugin's memory to the file.
  transport::proto::Saved save(const transport::proto::Save& m);
  // The same state for a replacement (`worker`: this worker's name, for the error), each value
  // copied by `adopt`.
  transport::proto::State state(const std::string& worker, const Adopt& adopt);

  // What `load` did with a donor's state.
  struct Loaded {
    std::optional<std::string> error;
    std::uint64_t instances = 0;  // loaded
    std::uint64_t bytes = 0;      // of their tensors
  };
  // Gives the instances here the state of the same instances on a donor (`what` begins an
  // error); entries of instances made on the donor only are skipped.
  Loaded load(std::vector<transport::proto::StateEntry>& entries, const std::string& what);

  // "Trainer" for an instance here; "?" for one this worker does not have.
  std::string class_of(std::uint64_t id) const;
  // Runs every destructor (a shutdown). The destructor of this object runs none: a worker that
  // ends otherwise is leaving at once.
  void clear();

 private:
  struct Instance {
    const plugins::ClassInfo* cls;
    void* self;
    std::string key;  // its state's name in checkpoints
  };

  std::optional<std::string> restore(const plugins::ClassInfo& cls, void* self,
                                     const std::string& key);
  template <class Take>
  std::optional<std::string> save_one(const Instance& inst, Take&& take);

  const plugins::Plugin& plugin_;
  twk_host_v1& host_;
  Context context_;
  std::map<std::uint64_t, Instance> instances_;
  std::vector<std::uint64_t> order_;        // instances_ in the order they were made
  std::map<std::string, int> made_;         // "maker/Class" -> how many were made here
  std::optional<checkpoint::Part> resume_;  // a resumed run: this worker's part
  std::string resume_error_;                // ... or why it could not be read
  std::int64_t resume_step_ = 0;
};

}  // namespace twinkle::core
