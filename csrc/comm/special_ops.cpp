#include "comm/special_ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "comm/checks.h"
#include "comm/group_ops.h"

namespace bytescale {
namespace comm {
namespace special_ops {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Monitored-barrier messages carry their own user tags (below bytescale's internal tags, above any
// tag a user plausibly picks), distinct per group and per call, so a barrier that failed (its
// receives stay posted) never swallows the messages of a later one.
constexpr uint32_t kMonitoredTagBase = 0x30000000u;
constexpr uint32_t kMonitoredTagMask = 0x0FFFFFFFu;

int monitoredTag(const RankMap& g, uint64_t seq, int phase) {
  uint64_t h = kFnvOffset;
  for (int r : g.ranks()) h = fnv1a(h, static_cast<uint64_t>(r));
  h = fnv1a(h, seq * 2 + static_cast<uint64_t>(phase));
  return static_cast<int>(kMonitoredTagBase | (static_cast<uint32_t>(h) & kMonitoredTagMask));
}

std::string joinRanks(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

std::string errorText(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->msg();
  return e.what();
}

[[noreturn]] void fail(const std::string& msg) {
  TORCH_CHECK_WITH(DistBackendError, false, msg);
}

c10::intrusive_ptr<c10d::Work> post(Transport& tr, P2POp::Kind kind, int peer, at::Tensor t,
                                    int tag, const std::string& what, milliseconds timeout) {
  WorkInfo info;
  info.type = kind == P2POp::kSend ? c10d::OpType::SEND : c10d::OpType::RECV;
  info.what = what;
  info.peers = {peer};
  info.timeout = timeout;
  return tr.post({P2POp{kind, peer, std::move(t), tag}}, std::move(info));
}

}  // namespace

void monitoredBarrier(Transport& tr, const RankMap& g, milliseconds timeout, bool wait_all_ranks,
                      uint64_t seq, const std::string& what) {
  const int n = g.size(), me = g.myIndex();
  if (n == 1) return;
  const int root = g.globalRank(0);
  const int arrive = monitoredTag(g, seq, 0), release = monitoredTag(g, seq, 1);
  const milliseconds group_timeout = tr.timeout();
  auto token = [&] { return at::full({1}, static_cast<int64_t>(g.globalRank(me)), at::kLong); };

  if (me != 0) {
    // Only the first member enforces `timeout`: the others must not fail before it reports.
    std::string error;
    at::Tensor answer = token();
    try {
      auto s = post(tr, P2POp::kSend, root, token(), arrive, what, group_timeout);
      auto r = post(tr, P2POp::kRecv, root, answer, release, what, group_timeout);
      s->wait();
      r->wait();
      const int64_t v = answer.item<int64_t>();
      if (v < 0)
        error = "rank " + std::to_string(root) + " reported that rank " + std::to_string(-v - 1) +
                " (and maybe others) did not arrive in time";
    } catch (const std::exception& e) {
      error = errorText(e);
    }
    if (!error.empty()) {
      std::ostringstream os;
      os << "bytescale " << what << ": Rank " << g.globalRank(me)
         << " successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank "
         << root << ". Please check rank " << root << " logs for faulty rank. Original error: "
         << error;
      fail(os.str());
    }
    return;
  }

  const auto start = Clock::now();
  auto remaining = [&] {
    if (wait_all_ranks) return timeout;  // each rank gets the whole timeout
    return timeout - std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  };
  // A member whose connection is already gone fails at posting: its Work is null and its error
  // is kept, so it is reported like one that did not answer.
  std::map<int, std::string> post_errors;
  auto tryPost = [&](int rank, P2POp::Kind kind, at::Tensor t, int tag) {
    try {
      return post(tr, kind, rank, std::move(t), tag, what, group_timeout);
    } catch (const std::exception& e) {
      post_errors[rank] = errorText(e);
      return c10::intrusive_ptr<c10d::Work>();
    }
  };
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> arrivals;
  for (int j = 1; j < n; ++j)
    arrivals.emplace_back(g.globalRank(j), tryPost(g.globalRank(j), P2POp::kRecv, token(), arrive));

  // The answer every other member waits for: its own rank (>= 0) to pass, -(r + 1) when rank r
  // did not arrive in time. Failing, the first member tells the others at once (they raise naming
  // it) instead of leaving them to their group timeout; those sends are not waited for.
  auto answerAll = [&](int64_t value) {
    std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
    for (int j = 1; j < n; ++j)
      works.emplace_back(g.globalRank(j), tryPost(g.globalRank(j), P2POp::kSend,
                                                  at::full({1}, value, at::kLong), release));
    return works;
  };
  auto failWith = [&](int first_failed, const std::string& msg) {
    if (first_failed >= 0) answerAll(-static_cast<int64_t>(first_failed) - 1);
    fail(msg);
  };
  // Waits for each Work in turn; raises naming the ranks that did not answer (at the first one
  // unless wait_all_ranks). `notify`: tell the others when failing (arrivals only).
  auto waitAll = [&](const std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>>& works,
                     bool notify) {
    std::vector<int> ok, failed;
    for (const auto& [rank, work] : works) {
      const milliseconds left = remaining();
      if (!wait_all_ranks && left <= milliseconds(0)) {
        std::ostringstream os;
        os << "bytescale " << what << ": Rank " << root << " timed out in monitoredBarrier after "
           << timeout.count() << " ms (ranks that answered: "
           << (ok.empty() ? std::string("none") : joinRanks(ok)) << ")";
        failWith(notify ? rank : -1, os.str());
      }
      std::string error;
      if (!work) {
        error = post_errors[rank];
      } else {
        try {
          work->wait(std::max(left, milliseconds(1)));  // wait(0) would mean "the group's timeout"
          ok.push_back(rank);
          continue;
        } catch (const std::exception& e) {
          error = errorText(e);
        }
      }
      if (!wait_all_ranks) {
        std::ostringstream os;
        os << "bytescale " << what << ": Rank " << rank << " failed to pass monitoredBarrier in "
           << timeout.count() << " ms. Original error: " << error;
        failWith(notify ? rank : -1, os.str());
      }
      failed.push_back(rank);
    }
    if (!failed.empty()) {
      std::ostringstream os;
      os << "bytescale " << what << ": " << (failed.size() == 1 ? "Rank " : "Ranks ")
         << joinRanks(failed) << " failed to pass monitoredBarrier in " << timeout.count() << " ms";
      failWith(notify ? failed[0] : -1, os.str());
    }
  };
  waitAll(arrivals, true);
  // Every member arrived: release them all (a true barrier: all pass or none does).
  waitAll(answerAll(root), false);
}

void sparseAllReduce(Transport& tr, const RankMap& g, const std::vector<at::Tensor>& tensors,
                     const std::string& what) {
  at::AutoDispatchBelowAutograd no_autograd;
  at::Tensor input = tensors[0];
  for (size_t i = 1; i < tensors.size(); ++i) input = input + tensors[i];
  input = input.coalesce();
  const int n = g.size();
  at::Tensor output = input;
  if (n > 1) {
    // What every member holds: sparse dims, dense dims, dtype, a hash of the sizes, nnz.
    constexpr int kMeta = 5;
    uint64_t h = kFnvOffset;
    for (int64_t s : input.sizes()) h = fnv1a(h, static_cast<uint64_t>(s));
    at::Tensor meta = at::tensor({input.sparse_dim(), input.dense_dim(),
                                  static_cast<int64_t>(input.scalar_type()),
                                  static_cast<int64_t>(h), input._nnz()},
                                 at::kLong);
    at::Tensor metas = at::empty({n, kMeta}, at::kLong);
    group_ops::allGather(tr, g, metas, meta, what);
    const int64_t* m = metas.data_ptr<int64_t>();
    for (int j = 1; j < n; ++j) {
      for (int k = 0; k < kMeta - 1; ++k) {
        if (m[j * kMeta + k] == m[k]) continue;
        std::ostringstream os;
        os << "bytescale " << what << ": the members disagree on the sparse tensor: rank "
           << g.globalRank(0) << " has " << m[0] << " sparse and " << m[1]
           << " dense dims, dtype " << c10::toString(static_cast<at::ScalarType>(m[2]))
           << ", sizes hash " << m[3] << "; rank " << g.globalRank(j) << " has " << m[j * kMeta]
           << " sparse and " << m[j * kMeta + 1] << " dense dims, dtype "
           << c10::toString(static_cast<at::ScalarType>(m[j * kMeta + 2])) << ", sizes hash "
           << m[j * kMeta + 3];
        TORCH_CHECK(false, os.str());
      }
    }
    int64_t max_nnz = 0;
    for (int j = 0; j < n; ++j) max_nnz = std::max(max_nnz, m[j * kMeta + 4]);
    const int64_t nnz = input._nnz(), sparse_dim = input.sparse_dim();
    // Indices (sparse_dim, max_nnz) and values (max_nnz, dense sizes...), zero-padded.
    at::Tensor idx = at::zeros({sparse_dim, max_nnz}, at::kLong);
    idx.narrow(1, 0, nnz).copy_(input._indices());
    std::vector<int64_t> vsizes = input._values().sizes().vec();
    vsizes[0] = max_nnz;
    at::Tensor val = at::zeros(vsizes, input._values().options());
    val.narrow(0, 0, nnz).copy_(input._values());
    at::Tensor all_idx = at::empty({n, sparse_dim, max_nnz}, at::kLong);
    std::vector<int64_t> all_vsizes{n};
    all_vsizes.insert(all_vsizes.end(), vsizes.begin(), vsizes.end());
    at::Tensor all_val = at::empty(all_vsizes, val.options());
    group_ops::allGather(tr, g, all_idx, idx, what);
    group_ops::allGather(tr, g, all_val, val, what);
    for (int j = 0; j < n; ++j) {
      const int64_t nj = m[j * kMeta + 4];
      at::Tensor part = at::sparse_coo_tensor(all_idx[j].narrow(1, 0, nj),
                                              all_val[j].narrow(0, 0, nj), input.sizes(),
                                              input.options());
      output = j == 0 ? part : output + part;
    }
    output = output.coalesce();
  }
  for (const auto& t : tensors) const_cast<at::Tensor&>(t).copy_(output);
}

}  // namespace special_ops
}  // namespace comm
}  // namespace bytescale
