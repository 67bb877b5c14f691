#include "attention/block_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/zigzag.h"

namespace bytescale {
namespace attention {

namespace {

bool contiguous(const std::vector<Segment>& segs, int64_t rows, bool queries) {
  int64_t next = 0;
  for (const auto& s : segs) {
    const int64_t start = queries ? s.q0 : s.k0;
    if (start != next) return false;
    next = start + (queries ? s.qn : s.kn);
  }
  return next == rows;
}

void push(BlockPlan& p, int64_t q0, int64_t qn, int64_t k0, int64_t kn) {
  if (qn > 0 && kn > 0) p.segs.push_back(Segment{q0, qn, k0, kn});
}

}  // namespace

bool BlockPlan::queriesContiguous() const { return contiguous(segs, q_rows, true); }
bool BlockPlan::keysContiguous() const { return contiguous(segs, k_rows, false); }

int64_t BlockPlan::maxQ() const {
  int64_t m = 0;
  for (const auto& s : segs) m = std::max(m, s.qn);
  return m;
}

int64_t BlockPlan::maxK() const {
  int64_t m = 0;
  for (const auto& s : segs) m = std::max(m, s.kn);
  return m;
}

int64_t BlockPlan::visiblePairs() const {
  int64_t c = 0;
  for (const auto& s : segs) c += causal ? s.qn * (s.qn + 1) / 2 : s.qn * s.kn;
  return c;
}

BlockPlan localPlan(const std::vector<int64_t>& lens, bool causal) {
  BlockPlan p;
  p.causal = causal;
  int64_t off = 0;
  for (int64_t s : lens) {
    if (s < 0) throw std::invalid_argument("localPlan: negative document length " + std::to_string(s));
    push(p, off, s, off, s);
    off += s;
  }
  p.q_rows = p.k_rows = off;
  return p;
}

BlockPlan zigzagPlan(const std::vector<int64_t>& lens, int64_t n, int64_t qp, int64_t kp, bool causal) {
  BlockPlan p;
  p.causal = causal && qp == kp;
  int64_t qoff = 0, koff = 0;
  for (int64_t s : lens) {
    zigzag::check(s, n, qp);
    zigzag::check(s, n, kp);
    const auto qr = zigzag::local_ranges(s, n, qp), kr = zigzag::local_ranges(s, n, kp);
    const int64_t qfirst = qr[0].second - qr[0].first, qn = zigzag::local_tokens(s, n, qp);
    const int64_t kfirst = kr[0].second - kr[0].first, kn = zigzag::local_tokens(s, n, kp);
    if (!causal || qp == kp)
      push(p, qoff, qn, koff, kn);
    else if (kp < qp)
      push(p, qoff, qn, koff, kfirst);
    else
      push(p, qoff + qfirst, qn - qfirst, koff, kn);
    qoff += qn;
    koff += kn;
  }
  p.q_rows = qoff;
  p.k_rows = koff;
  return p;
}

}  // namespace attention
}  // namespace bytescale
