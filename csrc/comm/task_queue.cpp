#include "comm/task_queue.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

namespace bytescale {
namespace comm {

struct TaskQueue::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> tasks;
  std::vector<std::thread> threads;
  size_t max_threads = 1;
  size_t idle = 0;
  bool closed = false;
  bool cancel = false;
};

namespace {

thread_local const void* t_queue = nullptr;  // the State of the queue this thread serves

void serve(const std::shared_ptr<TaskQueue::State>& st) {
  t_queue = st.get();
  for (;;) {
    TaskQueue::Task task;
    bool cancelled = false;
    {
      std::unique_lock<std::mutex> lk(st->mu);
      ++st->idle;
      st->cv.wait(lk, [&] { return st->closed || !st->tasks.empty(); });
      --st->idle;
      if (st->tasks.empty()) return;  // closed and drained
      task = std::move(st->tasks.front());
      st->tasks.pop_front();
      cancelled = st->cancel;
    }
    try {
      task(cancelled);
    } catch (...) {
      // A task reports its own failures; an escaping exception must not std::terminate.
    }
  }
}

}  // namespace

TaskQueue::TaskQueue(size_t max_threads) : st_(std::make_shared<State>()) {
  st_->max_threads = max_threads < 1 ? 1 : max_threads;
}

TaskQueue::~TaskQueue() { close(true); }

bool TaskQueue::push(Task task) {
  // A local reference: the task may start at once and drop the last reference to this queue's
  // owner (and so to `this`) before push() returns.
  std::shared_ptr<State> st = st_;
  std::lock_guard<std::mutex> g(st->mu);
  if (st->closed) return false;
  st->tasks.push_back(std::move(task));
  if (st->tasks.size() > st->idle && st->threads.size() < st->max_threads) {
    try {
      st->threads.emplace_back([st] { serve(st); });
    } catch (const std::system_error& e) {
      if (st->threads.empty()) {
        st->tasks.pop_back();
        throw std::runtime_error(std::string("bytescale: cannot start a thread: ") + e.what());
      }
      // Enough threads exist to make progress; the task waits for one of them.
    }
  }
  st->cv.notify_one();
  return true;
}

void TaskQueue::close(bool cancel_pending) {
  std::shared_ptr<State> st = st_;  // see push()
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> g(st->mu);
    if (!st->closed) {
      st->closed = true;
      st->cancel = cancel_pending;
    }
    threads.swap(st->threads);
    st->cv.notify_all();
  }
  for (auto& t : threads) {
    if (t.get_id() == std::this_thread::get_id())
      t.detach();  // closing from a task: this thread exits by itself after the task
    else
      t.join();
  }
}

bool TaskQueue::onQueueThread() const { return t_queue == st_.get(); }

size_t TaskQueue::threadCount() const {
  std::lock_guard<std::mutex> g(st_->mu);
  return st_->threads.size();
}

}  // namespace comm
}  // namespace bytescale
