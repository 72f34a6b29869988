/* Twinkle plugin ABI, version 1.
 *
 * A plugin is a shared object that exports one symbol, `twinkle_plugin_v1`, returning a static
 * table that describes its classes, their remote methods, its driver entries and its custom
 * dispatch/collect functions. Everything crossing the boundary is plain C: values travel as
 * msgpack bytes plus separate tensor buffers, errors as a status code plus a message written to a
 * sink. No C++ exception ever crosses. The host hands the plugin a table of its own functions
 * (twk_host_v1), so a plugin links nothing of Twinkle's.
 *
 * Compatibility: every table starts with its `size` (and the plugin table with `abi_version`);
 * hosts read only the fields that `size` covers, and fields are only ever appended. Enumerations
 * have explicit values that never change meaning.
 *
 * Most authors use the C++ SDK in <twinkle/plugin.hpp>, which fills these tables.
 */
#ifndef TWINKLE_PLUGIN_H
#define TWINKLE_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TWK_ABI_VERSION 1u
#define TWK_ENTRY_SYMBOL "twinkle_plugin_v1"

/* How a call's arguments are split across the executing workers. */
enum {
  TWK_DISPATCH_ALL = 0,      /* every worker receives the same arguments */
  TWK_DISPATCH_SLICE = 1,    /* top-level lists/tensors split along dim 0 by worker index */
  TWK_DISPATCH_SLICE_DP = 2, /* split by data rank of the mesh; maps sliced per key */
  TWK_DISPATCH_CUSTOM = 3    /* a plugin function named by twk_method_v1.custom_dispatch */
};

/* Which workers run a call. */
enum {
  TWK_EXECUTE_ALL = 0,   /* every worker of the group */
  TWK_EXECUTE_FIRST = 1, /* worker 0 only, with the unsliced arguments */
  TWK_EXECUTE_PEER = 2,  /* from the driver: all; from another group's worker: its peer block */
  TWK_EXECUTE_CLASS = 3  /* methods only: whatever the class says */
};

/* How the driver combines the per-worker results. */
enum {
  TWK_COLLECT_NONE = 0,    /* the list of results (a single result unwrapped) */
  TWK_COLLECT_MEAN = 1,    /* numbers, tensors, maps per key, lists per position, averaged */
  TWK_COLLECT_SUM = 2,     /* the same, summed */
  TWK_COLLECT_FIRST = 3,   /* worker 0's result */
  TWK_COLLECT_LAST_PP = 4, /* the results of the last pipeline stage */
  TWK_COLLECT_FLATTEN = 5, /* lists/tensors concatenated along dim 0, one per data rank */
  TWK_COLLECT_CUSTOM = 6   /* a plugin function named by twk_method_v1.custom_collect */
};

/* Element types of tensors. */
enum {
  TWK_DTYPE_F32 = 0,
  TWK_DTYPE_F64 = 1,
  TWK_DTYPE_I32 = 2,
  TWK_DTYPE_I64 = 3,
  TWK_DTYPE_U8 = 4,
  TWK_DTYPE_I8 = 5,
  TWK_DTYPE_F16 = 6,
  TWK_DTYPE_BF16 = 7,
  TWK_DTYPE_BOOL = 8
};

/* Status codes returned by every plugin function. */
enum { TWK_OK = 0, TWK_ERROR = 1 };

/* Reductions of the collectives. MEAN is SUM divided by the communicator's size (integer types
 * divide with truncation). */
enum { TWK_REDUCE_SUM = 0, TWK_REDUCE_MEAN = 1, TWK_REDUCE_MAX = 2, TWK_REDUCE_MIN = 3 };

/* Log levels of twk_host_v1.log. */
enum { TWK_LOG_DEBUG = 0, TWK_LOG_INFO = 1, TWK_LOG_WARN = 2, TWK_LOG_ERROR = 3 };

/* An error message that starts with this is a lost worker's (its group restarts): the SDK throws
 * twinkle::WorkerLost for it, without the tag. */
#define TWK_WORKER_LOST_TAG "worker lost: "

/* msgpack extension type that stands for a tensor; its payload is the tensor's index in
 * twk_value_v1.tensors as a 4-byte big-endian unsigned integer. */
#define TWK_MSGPACK_EXT_TENSOR 1

/* A tensor payload: dense, row-major, `nbytes` = numel * element size. */
typedef struct twk_tensor_v1 {
  int32_t dtype;
  int32_t ndim;
  const int64_t* shape;
  const void* data;
  uint64_t nbytes;
} twk_tensor_v1;

/* A value: its structure as msgpack bytes, its tensors as separate buffers. Borrowed: valid for
 * the duration of the call it is passed to. If `retain` is set, the receiver may keep the tensor
 * memory beyond the call by calling retain(owner) once and release(owner) when done. */
typedef struct twk_value_v1 {
  const uint8_t* msgpack;
  uint64_t msgpack_size;
  const twk_tensor_v1* tensors;
  uint32_t n_tensors;
  void* owner;
  void (*retain)(void* owner);
  void (*release)(void* owner);
} twk_value_v1;

/* Where a callee puts its result or its error. Whoever receives the sink copies what it needs
 * before set_value/set_error returns. Thread-compatible: one sink per call. */
typedef struct twk_sink_v1 {
  void* target;
  void (*set_value)(void* target, const twk_value_v1* value);
  void (*set_error)(void* target, const char* message);
} twk_sink_v1;

/* A device mesh: `ndims` named dimensions laid out row-major, outermost first. `coords` holds
 * world_size x ndims coordinates (rank-major), `data_ranks` world_size entries. */
typedef struct twk_mesh_v1 {
  uint32_t size;
  uint32_t ndims;
  const char* const* dim_names;
  const int32_t* dim_sizes;
  int32_t ep;
  int32_t world_size;
  int32_t data_world;
  const int32_t* coords;
  const int32_t* data_ranks;
} twk_mesh_v1;

/* What a constructor, method or driver entry knows about where it runs. In a driver entry rank is
 * -1 and mesh is NULL. */
typedef struct twk_context_v1 {
  uint32_t size;
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  int32_t local_world_size;
  const char* job;
  const char* group;
  const char* device; /* "cpu" | "cuda" */
  const twk_mesh_v1* mesh;
  const twk_value_v1* args; /* the job's [args] */
  void* host_ctx;           /* pass back to twk_host_v1 functions */
  const char* job_dir;      /* the folder of the job file, for paths in [args] */
} twk_context_v1;

/* The host's functions. create/call/wait/release work in driver entries and, with hosts whose
 * `size` covers `attach`, in worker methods too (calls between groups: a worker's calls go straight
 * to the target workers). Every operation returns TWK_OK or TWK_ERROR with the message written
 * to `err`. */
typedef struct twk_host_v1 {
  uint32_t size;
  uint32_t abi_version;
  void (*log)(void* host_ctx, int32_t level, const char* message);
  /* Construct class `cls` on every worker of `group` with constructor arguments `args` (from a
   * worker, a class with execute = peer only on the caller's peer block of `group`). */
  int32_t (*create)(void* host_ctx, const char* cls, const char* group, const twk_value_v1* args,
                    uint64_t* handle, twk_sink_v1* err);
  /* Start a call and return at once with a future. caller_* is the calling code's call site. */
  int32_t (*call)(void* host_ctx, uint64_t handle, const char* method, const twk_value_v1* args,
                  const char* caller_file, uint32_t caller_line, uint64_t* future,
                  twk_sink_v1* err);
  /* Block until the future completes; its collected result goes to `out`. */
  int32_t (*wait)(void* host_ctx, uint64_t future, twk_sink_v1* out);
  /* Forget a future whose result is not wanted. */
  void (*release)(void* host_ctx, uint64_t future);

  /* Workers: collectives. `dim` NULL or "" is the whole group; "dp", "tp", "pp", "ep", ... the
   * mesh sub-group this worker belongs to. Communicators are created on first use (all members
   * must make the same calls in the same order) and cached. Buffers are host memory for cpu
   * groups (Gloo) and device memory for cuda groups (NCCL). `count` is in elements; all_gather
   * and reduce_scatter take `count` elements per rank (out has count x size, in has count x size
   * respectively). Blocking; a peer that died or hangs fails the call within its timeout. */
  int32_t (*comm_info)(void* host_ctx, const char* dim, int32_t* rank, int32_t* size,
                       twk_sink_v1* err);
  int32_t (*all_reduce)(void* host_ctx, const char* dim, void* data, uint64_t count, int32_t dtype,
                        int32_t op, twk_sink_v1* err);
  int32_t (*broadcast)(void* host_ctx, const char* dim, void* data, uint64_t count, int32_t dtype,
                       int32_t root, twk_sink_v1* err);
  int32_t (*all_gather)(void* host_ctx, const char* dim, const void* in, void* out, uint64_t count,
                        int32_t dtype, twk_sink_v1* err);
  int32_t (*reduce_scatter)(void* host_ctx, const char* dim, const void* in, void* out,
                            uint64_t count, int32_t dtype, int32_t op, twk_sink_v1* err);
  int32_t (*barrier)(void* host_ctx, const char* dim, twk_sink_v1* err);

  /* Fields below were added after the first release: check `size` before using them. */

  /* Driver: declare the communicator `name` across groups over `members`, a list of
   * [group, [worker indices...]] pairs in rank order (an empty list: every worker of the group).
   * Its members reach it as comm(name), with the collectives above. Joining is collective: the
   * first collective on it waits up to `timeout_s` (0: the job's) for every member, and fails
   * naming those that never joined. */
  int32_t (*comm_create)(void* host_ctx, const char* name, const twk_value_v1* members,
                         double timeout_s, twk_sink_v1* err);
  /* Workers: make `instance`, an instance of class `cls` on `group` made elsewhere (its handle
   * came as an argument), callable from this worker with call(). */
  int32_t (*attach)(void* host_ctx, const char* cls, const char* group, uint64_t instance,
                    twk_sink_v1* err);

  /* Fields below were added with checkpoints: check `size` before using them. */

  /* Driver: every instance whose class has state (twk_class_v1.save) saves it; each worker
   * writes its own part of the checkpoint into [job] checkpoint_dir and the host publishes it,
   * with `step` and `meta` (a value without tensors), once every part is on disk. *saved is 0
   * when the job has no checkpoint_dir (nothing is written), else 1. */
  int32_t (*checkpoint)(void* host_ctx, int64_t step, const twk_value_v1* meta, int32_t* saved,
                        twk_sink_v1* err);
  /* Driver: the checkpoint this run resumed from, as a map {step, meta} to `out`; null when the
   * run started fresh. */
  int32_t (*resumed)(void* host_ctx, twk_sink_v1* out);
  /* Driver: 1 once a stop was requested (SIGTERM or SIGUSR1 with a checkpoint_dir): the entry
   * should checkpoint and return within [job] stop_grace_s. */
  int32_t (*stop_requested)(void* host_ctx);
} twk_host_v1;

typedef int32_t (*twk_construct_fn)(const twk_host_v1* host, const twk_context_v1* ctx,
                                    const twk_value_v1* args, void** self, twk_sink_v1* err);
typedef void (*twk_destruct_fn)(void* self);
/* State: the instance's state as a value (a map of tensors and numbers) to `out`. */
typedef int32_t (*twk_save_fn)(void* self, const twk_host_v1* host, const twk_context_v1* ctx,
                               twk_sink_v1* out);
/* State: restore what save gave, right after the constructor ran. */
typedef int32_t (*twk_load_fn)(void* self, const twk_host_v1* host, const twk_context_v1* ctx,
                               const twk_value_v1* state, twk_sink_v1* err);
typedef int32_t (*twk_invoke_fn)(void* self, const twk_host_v1* host, const twk_context_v1* ctx,
                                 const twk_value_v1* args, twk_sink_v1* out);
typedef int32_t (*twk_driver_fn)(const twk_host_v1* host, const twk_context_v1* ctx,
                                 twk_sink_v1* err);
/* Custom dispatch: the arguments for executing worker `index` of `n_workers`. */
typedef int32_t (*twk_dispatch_fn)(int32_t n_workers, int32_t index, const twk_mesh_v1* mesh,
                                   const twk_value_v1* args, twk_sink_v1* out);
/* Custom collect: one result from the per-worker results (worker order). */
typedef int32_t (*twk_collect_fn)(const twk_value_v1* results, uint32_t n_results,
                                  const twk_mesh_v1* mesh, twk_sink_v1* out);

typedef struct twk_method_v1 {
  uint32_t size;
  const char* name;
  int32_t dispatch;
  int32_t execute;
  int32_t collect;
  double timeout_s;            /* 0: the job's timeout_s */
  const char* custom_dispatch; /* with TWK_DISPATCH_CUSTOM: a name in twk_plugin_v1.dispatchers */
  const char* custom_collect;  /* with TWK_COLLECT_CUSTOM: a name in twk_plugin_v1.collectors */
  twk_invoke_fn invoke;
  /* Added with restarts (check `size`): how many times a call is sent again, once its group is
   * back, when a worker of the group is lost before every answer came (0: it fails). */
  int32_t retries;
} twk_method_v1;

typedef struct twk_class_v1 {
  uint32_t size;
  const char* name;
  int32_t execute;
  twk_construct_fn construct;
  twk_destruct_fn destruct;
  const twk_method_v1* methods;
  uint32_t n_methods;
  /* Added with checkpoints (check `size`): both set, or neither (the class has no state). */
  twk_save_fn save;
  twk_load_fn load;
} twk_class_v1;

typedef struct twk_driver_v1 {
  const char* name;
  twk_driver_fn fn;
} twk_driver_v1;

typedef struct twk_dispatcher_v1 {
  const char* name;
  twk_dispatch_fn fn;
} twk_dispatcher_v1;

typedef struct twk_collector_v1 {
  const char* name;
  twk_collect_fn fn;
} twk_collector_v1;

typedef struct twk_plugin_v1 {
  uint32_t abi_version; /* TWK_ABI_VERSION */
  uint32_t size;        /* sizeof(twk_plugin_v1) as the plugin was built */
  const char* name;
  const char* version;
  const twk_class_v1* classes;
  uint32_t n_classes;
  const twk_driver_v1* drivers;
  uint32_t n_drivers;
  const twk_dispatcher_v1* dispatchers;
  uint32_t n_dispatchers;
  const twk_collector_v1* collectors;
  uint32_t n_collectors;
} twk_plugin_v1;

/* The one exported symbol. Returns a table that stays valid until the plugin is unloaded. */
typedef const twk_plugin_v1* (*twk_entry_v1_fn)(void);

#ifdef __cplusplus
} /* extern "C" */

/* Layout checks: a change here is an ABI change and needs a new version. */
static_assert(sizeof(twk_tensor_v1) == 32, "twk_tensor_v1 layout changed");
static_assert(sizeof(twk_value_v1) == 56, "twk_value_v1 layout changed");
static_assert(sizeof(twk_sink_v1) == 24, "twk_sink_v1 layout changed");
static_assert(sizeof(twk_mesh_v1) == 56, "twk_mesh_v1 layout changed");
static_assert(sizeof(twk_context_v1) == 80, "twk_context_v1 layout changed");
/* twk_host_v1 grows only at its end; users check `size` for the fields after barrier. */
static_assert(offsetof(twk_host_v1, barrier) == 88, "twk_host_v1 layout changed");
static_assert(offsetof(twk_host_v1, attach) == 104, "twk_host_v1 layout changed");
static_assert(sizeof(twk_host_v1) == 136, "twk_host_v1 layout changed");
static_assert(offsetof(twk_method_v1, invoke) == 56, "twk_method_v1 layout changed");
static_assert(sizeof(twk_method_v1) == 72, "twk_method_v1 layout changed");
/* twk_class_v1 grew at its end (save, load); arrays of classes are read with the stride of the
 * plugin's own `size`. */
static_assert(offsetof(twk_class_v1, n_methods) == 48, "twk_class_v1 layout changed");
static_assert(sizeof(twk_class_v1) == 72, "twk_class_v1 layout changed");
static_assert(sizeof(twk_plugin_v1) == 88, "twk_plugin_v1 layout changed");
static_assert(offsetof(twk_plugin_v1, size) == 4, "twk_plugin_v1 layout changed");
#endif

#endif /* TWINKLE_PLUGIN_H */
