#include "autotp/comm/comm_lane.h"

#include <stdexcept>

namespace autotp {

void LaneJob::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool LaneJob::finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

CommLane::~CommLane() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<LaneJob> CommLane::post(std::function<void()> fn) {
  auto job = std::make_shared<LaneJob>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(std::move(fn), job);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }
  work_cv_.notify_one();
  return job;
}

void CommLane::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && !running_job_; });
}

bool CommLane::idle() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.empty() && !running_job_;
}

void CommLane::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left to run
    auto [fn, job] = std::move(queue_.front());
    queue_.pop_front();
    running_job_ = true;
    lock.unlock();
    // After a failure the group is broken: later jobs fail at once instead of
    // each waiting out the timeout (a rank unwinding must exit quickly).
    std::exception_ptr error;
    if (!failure_.empty()) {
      error = std::make_exception_ptr(
          std::runtime_error("not run: an earlier collective of this group failed: " + failure_));
    } else {
      try {
        fn();
      } catch (const std::exception& e) {
        error = std::current_exception();
        failure_ = e.what();
      } catch (...) {
        error = std::current_exception();
        failure_ = "unknown error";
      }
    }
    fn = nullptr;  // drop what the job captured (its tensors) before it counts as done
    {
      std::lock_guard<std::mutex> job_lock(job->mutex_);
      job->done_ = true;
      job->error_ = error;
    }
    job->done_cv_.notify_all();
    lock.lock();
    running_job_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

}  // namespace autotp
