#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "transports/zmq/protocol.hpp"

// What a worker runs, as the chain of calls that led to it, and the checks that find a cycle of
// calls before it hangs (docs/ARCHITECTURE.md, Calls between groups): a request nested in this
// worker's own call (its chain passes through it), a request from a worker that this worker's
// call waits for, and rings of workers that wait on each other (probes). Used from the worker's
// thread.
namespace twinkle::core {

class CallChain {
 public:
  using Chain = std::vector<transport::proto::ChainLink>;

  // What the checks need of the worker's calls to others: the peers (run-wide worker indices)
  // its call in wait() still waits for, the index of a worker by name, sending a probe to a
  // peer, and failing the wait for a peer with an error (and waking the wait).
  struct Peers {
    std::function<std::vector<std::size_t>()> waiting;
    std::function<std::optional<std::size_t>(const std::string&)> index_of;
    std::function<void(std::size_t, const transport::proto::Probe&)> send_probe;
    std::function<void(std::size_t, const std::string&)> fail_waiting;
  };

  CallChain(std::string name, Peers peers) : name_(std::move(name)), peers_(std::move(peers)) {}

  // Runs `f` as this worker's current call, `what()` ("Trainer.step") asked by `caller` (its call
  // site) along `chain`; from the driver (`from_driver`) the chain starts at the driver's entry.
  // The calls this worker makes meanwhile carry chain(). `chain` and `caller` must outlive `f`;
  // `what` is asked only when the chain is needed (a call to another group, a cycle check, a
  // probe), so that a call that needs none costs no string.
  template <class F>
  void run(const Chain& chain, bool from_driver, std::function<std::string()> what,
           const std::string& caller, F&& f) {
    begin(chain, from_driver, std::move(what), caller);
    struct End {
      CallChain& c;
      ~End() { c.end(); }
    } end{*this};
    f();
  }
  const Chain& chain() const;
  bool busy() const { return busy_; }

  // The cycle that running request `what` (asked at `caller`, along `chain`, by worker `from`)
  // after the current call would close, as its error; nullopt when there is none (the request
  // waits its turn).
  std::optional<std::string> find_cycle(const Chain& chain, const std::string& from,
                                        const std::string& what, const std::string& caller) const;

  // While this worker waits in a call: sends a probe along every call it waits for.
  void send_probes();
  // A probe from another worker: passed on along this worker's own waits, or, back at its
  // origin in the same call, the ring it went round fails the wait it was sent along.
  void on_probe(transport::proto::Probe& probe);

  // "trainer:0 Trainer.step (called at train.cpp:12)"
  static std::string link_text(const transport::proto::ChainLink& f);

 private:
  void begin(const Chain& chain, bool from_driver, std::function<std::string()> what,
             const std::string& caller);
  void end();
  std::string current() const;
  void forward(const transport::proto::Probe& probe, const std::vector<std::size_t>& to);

  std::string name_;
  Peers peers_;
  // The current call as begin() got it; chain_ is made from it when first needed.
  const Chain* incoming_ = nullptr;
  const std::string* caller_ = nullptr;
  std::function<std::string()> what_;
  bool from_driver_ = false;
  mutable Chain chain_;
  mutable bool built_ = false;
  bool busy_ = false;
  std::uint64_t tokens_ = 0, token_ = 0;  // the current call's number
};

}  // namespace twinkle::core
