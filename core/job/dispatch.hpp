#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "core/job/mesh.hpp"
#include "twinkle/metadata.hpp"
#include "twinkle/value.hpp"

// The metadata on every remote method (docs/ARCHITECTURE.md, Dispatch, execute and collect): how
// the driver hands arguments to the workers of a group (dispatch), which workers run the call
// (execute), and how their results are combined into the one value the driver returns (collect).
//
// Every function here is pure: no state, safe to call from any thread.
namespace twinkle::core {

// Dispatch, Execute and Collect (and their to_string) are the SDK's vocabulary:
// twinkle/metadata.hpp.
using twinkle::Collect;
using twinkle::Dispatch;
using twinkle::Execute;

// The half-open range [begin, end) of part `i` when `len` items are cut into `n` contiguous parts
// whose sizes differ by at most one, the first `len % n` parts one larger. Requires n >= 1 and
// 0 <= i < n (std::invalid_argument otherwise); parts are empty when len < n.
std::pair<std::int64_t, std::int64_t> balanced_range(std::int64_t len, int n, int i);

// A cross-group caller for execute = peer: the calling worker's rank and its group's world size.
struct PeerCaller {
  int rank;
  int world_size;
};

// Which workers (indices 0..mesh.world_size()-1, ascending) run a call.
//   all:   every worker.
//   first: {0}.
//   peer:  without a caller (the driver), every worker. With a caller of another group of w
//          workers and this group of n: when n >= w, block caller.rank of n workers cut into w
//          balanced contiguous blocks (balanced_range); when n < w, the single worker
//          caller.rank mod n (the mapping of Twinkle's Python get_peer_index).
// A caller with world_size < 1 or a rank outside [0, world_size) is std::invalid_argument.
std::vector<int> executing_workers(Execute e, const DeviceMesh& mesh,
                                   std::optional<PeerCaller> caller = std::nullopt);

// The positional arguments (a Value list; null counts as no arguments) that each executing worker
// receives, one entry per entry of `workers`. `what` names the call in errors ("Model.train_step").
//   all:      the same arguments for each worker.
//   slice:    every top-level list or tensor argument is cut along dim 0 into workers.size()
//             balanced parts; the worker at position i of `workers` gets part i. Other arguments
//             (maps included) are passed whole.
//   slice_dp: like slice, but there is one part per distinct data rank among `workers`
//             (mesh.data_rank), in ascending data-rank order, and each worker gets the part of its
//             data rank, so tp/pp/cp peers receive identical slices. Top-level maps are sliced per
//             key (list and tensor values cut, other values whole).
// Tensor slices share the argument's storage (Tensor::slice); list slices copy their items.
// 0-dimensional tensors cannot be cut and are passed whole.
// A list or tensor with fewer items than parts throws twinkle::Error naming the minimum batch size.
// Dispatch::custom runs a plugin function, not this one: std::invalid_argument. So is an `args`
// that is neither a list nor null.
std::vector<twinkle::Value> dispatch_args(Dispatch d, const twinkle::Value& args,
                                          const DeviceMesh& mesh, const std::vector<int>& workers,
                                          std::string_view what);

// Combines results[i], returned by workers[i], into what the driver returns. `what` names the call
// in errors. Mismatched input is twinkle::Error naming the call, the key path and the worker.
//   none:    the list of results; a single result unwrapped.
//   first:   results[0].
//   mean/sum: numbers reduced (a sum of ints stays an int, a mean is a double); tensors of one
//            dtype and shape reduced elementwise (float32/float64 keep their dtype and are computed
//            in double; integer tensors keep their dtype for sum and become float64 for mean;
//            bool, float16 and bfloat16 tensors are errors); maps per key (every result must have
//            the same keys); lists per position (the same lengths). Anything else (strings, null,
//            bools, kinds that differ between workers) is an error.
//   last_pp: the results of the workers whose pp coordinate is the last stage; a single one
//            unwrapped. An error when no executing worker is in the last stage.
//   flatten: one result per data rank (the first worker of each data rank in `workers` order), in
//            data-rank order, concatenated: lists joined, tensors joined along dim 0
//            (Tensor::concat), maps of lists/tensors joined per key.
// Collect::custom runs a plugin function, not this one: std::invalid_argument. So does
// results.size() != workers.size().
twinkle::Value collect_results(Collect c, std::vector<twinkle::Value> results,
                               const DeviceMesh& mesh, const std::vector<int>& workers,
                               std::string_view what);

}  // namespace twinkle::core
