// A FIFO of tasks run by a small set of threads the queue owns. Pure C++ (no torch).
//
// The threads share the queue's state through a shared_ptr, never the owner's `this`, so a task may
// drop the last reference to whatever owns the queue (the queue is then closed from one of its own
// threads, which detaches instead of joining itself: no std::thread is ever destroyed joinable and
// no thread joins itself). A task never ends a thread: exceptions escaping a task are swallowed
// (tasks report their own errors).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

namespace bytescale {
namespace comm {

class TaskQueue {
 public:
  // cancelled: true when the queue was closed with cancel_pending before the task started; the task
  // must then only report that it did not run.
  using Task = std::function<void(bool cancelled)>;

  // max_threads 1: tasks run one at a time in push order. More: a task starts as soon as a thread is
  // free; a thread is added (up to max_threads) whenever more tasks wait than threads are idle.
  explicit TaskQueue(size_t max_threads);
  ~TaskQueue();  // close(true)
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // False (task not queued) once closed. Throws std::runtime_error if no thread can be started.
  bool push(Task task);
  // Stops accepting tasks; the threads finish the queued ones (with cancelled=true if
  // cancel_pending) and exit; waits for them unless called from one of them. Idempotent.
  void close(bool cancel_pending);
  // True on one of this queue's threads.
  bool onQueueThread() const;
  size_t threadCount() const;

  struct State;  // shared with the threads (task_queue.cpp)

 private:
  std::shared_ptr<State> st_;
};

}  // namespace comm
}  // namespace bytescale
