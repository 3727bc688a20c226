// CommLane: one background thread that runs a group's asynchronous collectives
// one at a time, in the order they were posted. Every member of a group posts
// the same sequence, so the lanes of all members meet in the same collectives.
// A lane belongs to one process group (Comms sharing a group share its lane);
// the owner keeps synchronous collectives of that group off the group while the
// lane has work (Comm waits for the lane first). post, drain and the jobs'
// waits may be called from any thread; jobs run on the lane's thread only.
// Once a job has failed the group is taken as broken: later jobs are not run
// and fail at once with that error (no second wait for a timeout).
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace autotp {

// One posted job: waitable once or many times; remembers what it threw.
class LaneJob {
 public:
  // Blocks until the job has run; rethrows its exception, if any (every time).
  void wait();
  bool finished() const;

 private:
  friend class CommLane;
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class CommLane {
 public:
  CommLane() = default;
  CommLane(const CommLane&) = delete;
  CommLane& operator=(const CommLane&) = delete;
  // Runs what is queued, then stops the thread.
  ~CommLane();

  // Queues `fn` behind everything posted before; the thread starts on first use.
  std::shared_ptr<LaneJob> post(std::function<void()> fn);
  // Blocks until every job posted so far has run (their errors stay with their jobs).
  void drain();
  bool idle() const;

 private:
  void loop();

  mutable std::mutex mutex_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<LaneJob>>> queue_;
  bool running_job_ = false;
  std::string failure_;  // the first failed job's error (lane thread only): later jobs are not run
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace autotp
