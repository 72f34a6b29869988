#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "transports/communicator.hpp"

// Collectives over shared memory for members on one host (docs/ARCHITECTURE.md, Collectives).
//
// Every member maps one anonymous segment (a memfd that rank 0 creates and the others open through
// /proc/PID/fd at rendezvous; nothing is named in /dev/shm, so it is gone once the last member
// exits, however it exits). The segment holds three sets of one slot per member, used in turn: a
// collective is cut into rounds of at most one slot per member, so the segment stays bounded
// whatever the buffer size. In a round of all_reduce every member copies its part into its slot,
// each member reduces its own share of the round across all slots, always in rank order 0..n-1,
// and every member copies the reduced shares out; the copy-in of one round, the reduction of
// the one before and the copy-out of the one before that share one barrier. Results are therefore
// bit-identical on every member and independent of timing and of the slot size.
//
// Members wait for each other on a futex in the segment, in slices: after each slice a waiter
// checks whether a peer's process exited (or its communicator was destroyed) and then fails naming
// that rank, so a peer killed mid-collective fails the others well within the timeout.
namespace twinkle::transport {

// Bytes of one member's slot when the caller does not choose: 8 MiB / size², between 128 KiB and
// 2 MiB, so that a round's data stays in cache as members are added (the segment holds 3 x size
// x slot plus a header: 12 MiB for 2 members, 3 MiB for 8).
std::size_t shm_slot_bytes(int size);

// A string equal for two processes exactly when they can share a segment: same kernel boot and
// same pid namespace (so that /proc/PID/fd of one is the other's).
std::string shm_host_id();

// Whether every member of `config` runs where this one does: each member publishes its
// shm_host_id() under the communicator's name, then reads everyone's. Collective: every member
// must call it. Throws TransportError naming the key if a member does not publish within the
// timeout.
bool members_share_host(KvStore& store, const CommConfig& config);

// A shared-memory communicator; every member must be on this host. Throws TransportError if the
// rendezvous does not complete within config.timeout or the segment cannot be shared. Reductions:
// float32, float64, int32, int64, int8, uint8, float16 and bfloat16 (the 16-bit floats accumulate
// in float32 and round once); bool is refused. `slot_bytes` (0: shm_slot_bytes(size)) is for
// tests of the pipelining.
std::unique_ptr<Communicator> create_shm_communicator(KvStore& store, const CommConfig& config,
                                                      std::size_t slot_bytes = 0);

}  // namespace twinkle::transport
