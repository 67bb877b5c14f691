// GoogleTest: the torch-free pieces of the comm subsystem: split-size normalisation and
// fingerprint comparison of the collective checks, and the task queue behind the CPU transport's
// worker and waiter threads (ordering, concurrency, cancellation, closing from its own thread,
// exceptions that must not end a thread).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "comm/checks.h"
#include "comm/task_queue.h"

using namespace bytescale::comm;

namespace {
std::string errorOf(std::vector<int64_t> splits, int64_t dim0, int n) {
  try {
    normalizeSplits(std::move(splits), dim0, n, "all_to_all_single on g", "input");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Splits, EmptyMeansEqual) {
  EXPECT_EQ(normalizeSplits({}, 12, 3, "op", "input"), (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(normalizeSplits({}, 0, 5, "op", "input"), (std::vector<int64_t>(5, 0)));
  EXPECT_EQ(normalizeSplits({}, 7, 1, "op", "input"), (std::vector<int64_t>{7}));
}

TEST(Splits, GivenSplitsAreKept) {
  EXPECT_EQ(normalizeSplits({1, 0, 6}, 7, 3, "op", "output"), (std::vector<int64_t>{1, 0, 6}));
}

TEST(Splits, ErrorsNameTheProblem) {
  EXPECT_NE(errorOf({}, 7, 3).find("dim 0 (7) is not divisible by the group size 3"),
            std::string::npos);
  EXPECT_NE(errorOf({1, 2}, 3, 3).find("has 2 split sizes for a group of 3"), std::string::npos);
  EXPECT_NE(errorOf({1, 2, 3}, 7, 3).find("split sizes sum to 6 but dim 0 is 7"),
            std::string::npos);
  EXPECT_NE(errorOf({4, -1, 4}, 7, 3).find("split size 1 is negative (-1)"), std::string::npos);
  EXPECT_NE(errorOf({4, -1, 4}, 7, 3).find("all_to_all_single on g: input"), std::string::npos);
}

TEST(Fingerprints, FirstMismatchingRow) {
  std::vector<int64_t> rows(3 * kFingerprintLen, 7);
  EXPECT_EQ(firstMismatchingRow(rows.data(), 3), -1);
  EXPECT_EQ(firstMismatchingRow(rows.data(), 1), -1);
  rows[2 * kFingerprintLen + kFingerprintLen - 1] = 8;  // last field of the last row
  EXPECT_EQ(firstMismatchingRow(rows.data(), 3), 2);
  rows[1 * kFingerprintLen] = 1;
  EXPECT_EQ(firstMismatchingRow(rows.data(), 3), 1);
}

TEST(Fingerprints, ShapeHashSeesOrder) {
  uint64_t a = fnv1a(fnv1a(kFnvOffset, 2), 3);
  uint64_t b = fnv1a(fnv1a(kFnvOffset, 3), 2);
  EXPECT_NE(a, b);
}

// ---- TaskQueue ---------------------------------------------------------------------------------

TEST(TaskQueue, OneThreadRunsInOrder) {
  std::vector<int> seen;
  std::mutex mu;
  {
    TaskQueue q(1);
    for (int i = 0; i < 100; ++i)
      ASSERT_TRUE(q.push([&, i](bool cancelled) {
        ASSERT_FALSE(cancelled);
        std::lock_guard<std::mutex> g(mu);
        seen.push_back(i);
      }));
    q.close(/*cancel_pending=*/false);  // drains
    EXPECT_FALSE(q.push([](bool) {}));
  }
  ASSERT_EQ(seen.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(seen[i], i);
}

TEST(TaskQueue, BlockedTaskDoesNotDelayOthers) {
  // A task that waits forever (until released) must not hold back later tasks when the queue may
  // use more threads: the CPU transport's waiters complete P2P Works independently.
  TaskQueue q(4);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> done{0};
  q.push([&](bool) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return release; });
    ++done;
  });
  for (int i = 0; i < 3; ++i) q.push([&](bool) { ++done; });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (done.load() < 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(done.load(), 3);
  EXPECT_LE(q.threadCount(), 4u);
  {
    std::lock_guard<std::mutex> g(mu);
    release = true;
  }
  cv.notify_all();
  q.close(false);
  EXPECT_EQ(done.load(), 4);
}

TEST(TaskQueue, CloseCancelsPendingTasks) {
  TaskQueue q(1);
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::atomic<int> ran{0}, cancelled{0};
  std::atomic<bool> started{false};
  q.push([&](bool c) {
    started = true;
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return go; });
    c ? ++cancelled : ++ran;
  });
  for (int i = 0; i < 5; ++i) q.push([&](bool c) { c ? ++cancelled : ++ran; });
  // Close only once the first task runs (on a loaded machine the thread may start late).
  while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread closer([&] { q.close(/*cancel_pending=*/true); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard<std::mutex> g(mu);
    go = true;
  }
  cv.notify_all();
  closer.join();
  EXPECT_EQ(ran.load(), 1);        // the running task finished normally
  EXPECT_EQ(cancelled.load(), 5);  // the queued ones were told they did not run
}

TEST(TaskQueue, OwnerDestroyedFromItsOwnTask) {
  // The last reference to the queue's owner is dropped inside a task: the queue is then closed
  // (and destroyed) on its own thread, which must neither join itself nor std::terminate.
  struct Owner {
    TaskQueue q{1};
  };
  auto owner = std::make_shared<Owner>();
  std::atomic<bool> done{false};
  std::weak_ptr<Owner> weak = owner;
  auto* raw = owner.get();
  raw->q.push([keep = std::move(owner), &done](bool) mutable {
    keep.reset();  // ~Owner -> ~TaskQueue -> close() on this very thread
    done = true;
  });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((!done.load() || !weak.expired()) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(done.load());
  EXPECT_TRUE(weak.expired());
}

TEST(TaskQueue, OwnerDestroyedWhilePushIsReturning) {
  // An idle thread may run the task (and destroy the owner, so the queue) before push() returns:
  // push() must not touch the queue object after queueing (run under ASan to see a violation).
  struct Owner {
    TaskQueue q{2};
  };
  for (int i = 0; i < 300; ++i) {
    auto owner = std::make_shared<Owner>();
    std::weak_ptr<Owner> weak = owner;
    auto* raw = owner.get();
    raw->q.push([](bool) {});  // starts a thread that then idles
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    std::atomic<bool> done{false};
    raw->q.push([keep = std::move(owner), &done](bool) mutable {
      keep.reset();
      done = true;
    });
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((!done.load() || !weak.expired()) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    ASSERT_TRUE(done.load() && weak.expired()) << "iteration " << i;
  }
}

TEST(TaskQueue, EscapingExceptionDoesNotEndTheThread) {
  TaskQueue q(1);
  std::atomic<int> after{0};
  q.push([](bool) { throw std::runtime_error("task failure"); });
  q.push([&](bool) { ++after; });
  q.close(false);
  EXPECT_EQ(after.load(), 1);
}

TEST(TaskQueue, OnQueueThread) {
  TaskQueue q(2);
  std::atomic<int> on{0};
  EXPECT_FALSE(q.onQueueThread());
  q.push([&](bool) { on = q.onQueueThread() ? 1 : 2; });
  q.close(false);
  EXPECT_EQ(on.load(), 1);
}

TEST(Agreement, RowsCarryTheirKind) {
  auto row = agreementRow(AgreementKind::kRingAttention, {5, 6, 7}, "op");
  ASSERT_EQ(row.size(), static_cast<size_t>(kAgreementLen));
  EXPECT_EQ(row[0], agreementHeader(AgreementKind::kRingAttention));
  EXPECT_EQ(row[1], 5);
  EXPECT_EQ(row[3], 7);
  EXPECT_EQ(row[4], 0);
  EXPECT_EQ(agreementKindName(row[0]), "ring attention's agreement check");
  EXPECT_EQ(agreementKindName(agreementHeader(AgreementKind::kPlan)), "the loader's plan check");
  EXPECT_NE(agreementKindName(12345).find("not an agreement"), std::string::npos);
  EXPECT_THROW(agreementRow(AgreementKind::kUser, std::vector<int64_t>(kAgreementPayload + 1),
                            "op"),
               std::invalid_argument);
}

TEST(Agreement, FirstKindMismatch) {
  std::vector<int64_t> rows;
  for (auto k : {AgreementKind::kCollective, AgreementKind::kCollective, AgreementKind::kPlan}) {
    auto r = agreementRow(k, {1, 2}, "op");
    rows.insert(rows.end(), r.begin(), r.end());
  }
  EXPECT_EQ(firstKindMismatch(rows.data(), 2), -1);
  EXPECT_EQ(firstKindMismatch(rows.data(), 3), 2);
  rows[kAgreementLen + 2] = 9;  // a payload difference is not a kind mismatch
  EXPECT_EQ(firstKindMismatch(rows.data(), 2), -1);
  EXPECT_EQ(firstMismatchingRow(rows.data(), 2, kAgreementLen), 1);
}
