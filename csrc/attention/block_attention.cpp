#include "attention/block_attention.h"

#include <ATen/ATen.h>

#include <limits>

namespace bytescale {
namespace attention {

namespace {

constexpr int64_t kQTile = 256;
constexpr int64_t kKTile = 1024;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// q/k/v shapes, dtypes and devices are checked once at the ops' entry (checkQKV in
// ring_attention.cpp); per block only the token metadata needs checking.
void checkInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const TokenMeta& qm,
                 const TokenMeta& km) {
  TORCH_CHECK(k.sizes() == v.sizes(), "bytescale attention: internal error, k ", k.sizes(),
              " and v ", v.sizes(), " differ in shape");
  TORCH_CHECK(qm.doc.numel() == q.size(0) && qm.pos.numel() == q.size(0),
              "bytescale attention: query metadata for ", qm.doc.numel(), " tokens, q has ", q.size(0));
  TORCH_CHECK(km.doc.numel() == k.size(0) && km.pos.numel() == k.size(0),
              "bytescale attention: key metadata for ", km.doc.numel(), " tokens, k has ", k.size(0));
}

// (Tq tile, Tk tile) visibility on the CPU. Returns 0: nothing visible, 1: everything, 2: mixed
// (then `mask` holds the (tq, tk) bool mask on the CPU).
int tileMask(const TokenMeta& qm, const TokenMeta& km, int64_t q0, int64_t q1, int64_t k0,
             int64_t k1, bool causal, at::Tensor& mask) {
  const int64_t* qd = qm.doc.data_ptr<int64_t>() + q0;
  const int64_t* qp = qm.pos.data_ptr<int64_t>() + q0;
  const int64_t* kd = km.doc.data_ptr<int64_t>() + k0;
  const int64_t* kp = km.pos.data_ptr<int64_t>() + k0;
  const int64_t tq = q1 - q0, tk = k1 - k0;
  mask = at::empty({tq, tk}, at::TensorOptions().dtype(at::kBool));
  bool* m = mask.data_ptr<bool>();
  int64_t count = 0;
  for (int64_t i = 0; i < tq; ++i)
    for (int64_t j = 0; j < tk; ++j) {
      bool vis = qd[i] == kd[j] && (!causal || kp[j] <= qp[i]);
      m[i * tk + j] = vis;
      count += vis;
    }
  if (count == 0) return 0;
  if (count == tq * tk) return 1;
  return 2;
}

// Set the scores (Hkv, tq*rep, tk) of invisible (query, key) pairs to -inf (vis == 2: mixed tile).
void applyMask(at::Tensor& s, const at::Tensor& mask, int vis, int64_t hkv, int64_t tq, int64_t rep,
               int64_t tk) {
  if (vis != 2) return;
  at::Tensor mk = mask.to(s.device(), /*non_blocking=*/true)
                      .view({1, tq, 1, tk})
                      .expand({hkv, tq, rep, tk})
                      .reshape({hkv, tq * rep, tk});
  s.masked_fill_(mk.logical_not(), kNegInf);
}

// q tile (tq, Hq, D) -> (Hkv, tq*rep, D) in dtype acc
at::Tensor groupQ(const at::Tensor& qt, int64_t hkv, at::ScalarType acc) {
  const int64_t tq = qt.size(0), hq = qt.size(1), d = qt.size(2), rep = hq / hkv;
  return qt.to(acc).reshape({tq, hkv, rep, d}).permute({1, 0, 2, 3}).reshape({hkv, tq * rep, d});
}

// (Hkv, tq*rep, X) -> (tq, Hq, X)
at::Tensor ungroupQ(const at::Tensor& g, int64_t tq, int64_t hq) {
  const int64_t hkv = g.size(0), rep = hq / hkv, x = g.size(2);
  return g.reshape({hkv, tq, rep, x}).permute({1, 0, 2, 3}).reshape({tq, hq, x});
}

}  // namespace

c10::ScalarType accType(c10::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

std::tuple<at::Tensor, at::Tensor> blockForward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const TokenMeta& qm,
                                                const TokenMeta& km, bool causal, double scale) {
  checkInputs(q, k, v, qm, km);
  const auto acc = accType(q.scalar_type());
  const int64_t Tq = q.size(0), Tk = k.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  const int64_t rep = Hq / Hkv;
  auto fopt = q.options().dtype(acc);
  at::Tensor out = at::zeros({Tq, Hq, D}, fopt);
  at::Tensor lse = at::full({Hq, Tq}, kNegInf, fopt);
  if (Tq == 0 || Tk == 0) return {out, lse};
  at::Tensor kg = k.to(acc).permute({1, 0, 2});  // (Hkv, Tk, D)
  at::Tensor vg = v.to(acc).permute({1, 0, 2});
  at::Tensor mask;
  for (int64_t q0 = 0; q0 < Tq; q0 += kQTile) {
    const int64_t q1 = std::min(Tq, q0 + kQTile), tq = q1 - q0;
    at::Tensor qg = groupQ(q.narrow(0, q0, tq), Hkv, acc);  // (Hkv, tq*rep, D)
    at::Tensor m = at::full({Hkv, tq * rep}, kNegInf, fopt);
    at::Tensor l = at::zeros({Hkv, tq * rep}, fopt);
    at::Tensor o = at::zeros({Hkv, tq * rep, D}, fopt);
    bool any = false;
    for (int64_t k0 = 0; k0 < Tk; k0 += kKTile) {
      const int64_t k1 = std::min(Tk, k0 + kKTile), tk = k1 - k0;
      int vis = tileMask(qm, km, q0, q1, k0, k1, causal, mask);
      if (vis == 0) continue;
      any = true;
      at::Tensor kt = kg.narrow(1, k0, tk), vt = vg.narrow(1, k0, tk);
      at::Tensor s = at::bmm(qg, kt.transpose(1, 2)).mul_(scale);  // (Hkv, tq*rep, tk)
      applyMask(s, mask, vis, Hkv, tq, rep, tk);
      at::Tensor m_new = at::maximum(m, std::get<0>(s.max(-1)));
      at::Tensor shift = m_new.masked_fill(at::isinf(m_new), 0.0);
      at::Tensor& p = s.sub_(shift.unsqueeze(-1)).exp_();  // in place: no second tile buffer
      at::Tensor corr = (m - shift).exp_();
      l.mul_(corr).add_(p.sum(-1));
      o.mul_(corr.unsqueeze(-1)).baddbmm_(p, vt);
      m = m_new;
    }
    if (!any) continue;
    at::Tensor l_safe = at::where(l > 0, l, at::ones_like(l));
    at::Tensor o_fin = o / l_safe.unsqueeze(-1);
    at::Tensor lse_t = at::where(l > 0, m + at::log(l_safe), at::full_like(l, kNegInf));
    out.narrow(0, q0, tq).copy_(ungroupQ(o_fin, tq, Hq));
    // lse (Hkv, tq*rep) -> (Hq, tq)
    lse.narrow(1, q0, tq).copy_(lse_t.reshape({Hkv, tq, rep}).permute({0, 2, 1}).reshape({Hq, tq}));
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> blockBackward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& lse, const at::Tensor& delta, const TokenMeta& qm, const TokenMeta& km,
    bool causal, double scale) {
  checkInputs(q, k, v, qm, km);
  const auto acc = accType(q.scalar_type());
  const int64_t Tq = q.size(0), Tk = k.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  const int64_t rep = Hq / Hkv;
  TORCH_CHECK(dout.sizes() == q.sizes(), "bytescale attention backward: grad_out ", dout.sizes(),
              " != q ", q.sizes());
  auto fopt = q.options().dtype(acc);
  at::Tensor dq = at::zeros({Tq, Hq, D}, fopt);
  at::Tensor dkg = at::zeros({Hkv, Tk, D}, fopt);
  at::Tensor dvg = at::zeros({Hkv, Tk, D}, fopt);
  if (Tq == 0 || Tk == 0)
    return {dq, dkg.permute({1, 0, 2}).contiguous(), dvg.permute({1, 0, 2}).contiguous()};
  at::Tensor kg = k.to(acc).permute({1, 0, 2});
  at::Tensor vg = v.to(acc).permute({1, 0, 2});
  // (Hq, Tq) -> per q tile (Hkv, tq*rep)
  auto groupRow = [&](const at::Tensor& x, int64_t q0, int64_t tq) {
    return x.narrow(1, q0, tq).reshape({Hkv, rep, tq}).permute({0, 2, 1}).reshape({Hkv, tq * rep});
  };
  at::Tensor lse_safe = at::where(at::isinf(lse), at::zeros_like(lse), lse).to(acc);
  at::Tensor mask;
  for (int64_t q0 = 0; q0 < Tq; q0 += kQTile) {
    const int64_t q1 = std::min(Tq, q0 + kQTile), tq = q1 - q0;
    at::Tensor qg = groupQ(q.narrow(0, q0, tq), Hkv, acc);
    at::Tensor dog = groupQ(dout.narrow(0, q0, tq), Hkv, acc);
    at::Tensor lrow = groupRow(lse_safe, q0, tq).unsqueeze(-1);
    at::Tensor drow = groupRow(delta.to(acc), q0, tq).unsqueeze(-1);
    at::Tensor dqg = at::zeros({Hkv, tq * rep, D}, fopt);
    bool any = false;
    for (int64_t k0 = 0; k0 < Tk; k0 += kKTile) {
      const int64_t k1 = std::min(Tk, k0 + kKTile), tk = k1 - k0;
      int vis = tileMask(qm, km, q0, q1, k0, k1, causal, mask);
      if (vis == 0) continue;
      any = true;
      at::Tensor kt = kg.narrow(1, k0, tk), vt = vg.narrow(1, k0, tk);
      at::Tensor s = at::bmm(qg, kt.transpose(1, 2)).mul_(scale);
      applyMask(s, mask, vis, Hkv, tq, rep, tk);
      at::Tensor& p = s.sub_(lrow).exp_();                   // (Hkv, tq*rep, tk)
      at::Tensor dvt = dvg.narrow(1, k0, tk);
      dvt.baddbmm_(p.transpose(1, 2), dog);
      at::Tensor ds = at::bmm(dog, vt.transpose(1, 2)).sub_(drow).mul_(p);  // p * (dp - delta)
      dqg.baddbmm_(ds, kt, 1.0, scale);
      at::Tensor dkt = dkg.narrow(1, k0, tk);
      dkt.baddbmm_(ds.transpose(1, 2), qg, 1.0, scale);
    }
    if (any) dq.narrow(0, q0, tq).copy_(ungroupQ(dqg, tq, Hq));
  }
  return {dq, dkg.permute({1, 0, 2}).contiguous(), dvg.permute({1, 0, 2}).contiguous()};
}

void mergeInto(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b) {
  at::Tensor mx = at::maximum(lse, lse_b);
  at::Tensor mx_safe = at::where(at::isinf(mx), at::zeros_like(mx), mx);
  at::Tensor wa = at::exp(lse - mx_safe), wb = at::exp(lse_b - mx_safe);  // 0 for -inf entries
  at::Tensor sum = wa + wb;
  at::Tensor new_lse = at::where(sum > 0, mx_safe + at::log(sum), at::full_like(sum, kNegInf));
  at::Tensor denom = at::where(sum > 0, sum, at::ones_like(sum));
  // (H, T) -> (T, H, 1)
  at::Tensor ca = (wa / denom).transpose(0, 1).unsqueeze(-1);
  at::Tensor cb = (wb / denom).transpose(0, 1).unsqueeze(-1);
  out.mul_(ca).add_(out_b * cb);
  lse.copy_(new_lse);
}

}  // namespace attention
}  // namespace bytescale
