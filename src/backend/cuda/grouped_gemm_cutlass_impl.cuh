// The CUTLASS side of the grouped GEMMs: the kernel configurations, the device-side setup of the
// per-expert arrays, and the launch. Included only by the grouped_gemm_cutlass_{tn,nn,wgrad,tn_m64*}.cu
// files (one instantiation each).
//
// Large configuration (all three training products): sm90 pointer-array grouped GEMM, TMA loads,
// warp-specialized cooperative schedule (two consumer warp groups on one 128x256 tile, K step 64),
// cluster 1x1, bf16 operands, f32 accumulation, epilogue D = alpha * acc + beta * C through TMA. The
// scheduler is persistent over (expert, tile) pairs read from the device problem shapes: with no host
// copy of the shapes CUTLASS launches one CTA per SM, and experts without tiles (M_e = 0) are skipped.
// Measured on an H200 in bench-4L (E=128, D=2048, F=768, R=32768, 4 layers): the experts' forward and
// backward take 11.4 ms per training step (62 ms on the per-expert cuBLASLt path). Of that, the two
// weight-gradient GEMMs are bound by their f32 += traffic (read and write 2.4 GB of dW per layer).
//
// Small configurations (the rows-grouped TN product only, i.e. the experts' forward, when rows per
// expert are few: decode, 16 rows per expert in bench-4L): the pingpong schedule on 64-row tiles,
// 64x256x64 or 64x128x64. Cooperative needs M >= 128 per tile, so at 16 rows 7/8 of its MMA work is
// padding; pingpong gives each consumer warp group a whole 64-row tile and alternates them, one
// group's MMAs overlapping the other's epilogue. The smaller A stage leaves room for more pipeline
// stages (StageCountAutoCarveout fills shared memory; as compiled with CUTLASS 4.2: 5 stages of 40 KB
// at 64x256 and 9 of 24 KB at 64x128, against 4 of 48 KB at 128x256, so 160 / 144 / 128 KB of
// weights in flight per SM; no register spills). Which one a call runs is grouped_gemm.cuh's RowsTile.
//
// CUTLASS's view of a product is D[M,N] = A[M,K] * B[K,N] with A given by (M, K) strides and B by
// (N, K) strides. In ours every matrix is row-major, so:
//   rows-grouped (M = M_e): A = rows of [R, K] (K-major, cutlass RowMajor); C = rows of [R, N] (RowMajor);
//     B_e [N, K] is K-major (cutlass ColumnMajor), B_e [K, N] is N-major (cutlass RowMajor);
//   K-grouped weight gradient (K = M_e): A[m, k] = A_rows[k, m] is M-major (cutlass ColumnMajor),
//     B[k, n] = B_rows[k, n] is N-major (cutlass RowMajor), W_e [M, N] f32 (RowMajor), C = D = W_e.
// Alignment: TMA needs 16-byte aligned bases and row strides; grouped_gemm_cutlass.cu checks them.
#pragma once
// CUTLASS's sm100 headers, pulled in by the builders, capture `this` implicitly (deprecated in C++20).
#pragma nv_diag_suppress 2908
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#pragma nv_diag_default 2908

#include <climits>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/grouped_gemm_cutlass.cuh"

namespace mt::cuda::grouped {

using GroupShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ShapeMNK = GroupShape::UnderlyingProblemShape;
using ClusterMNK = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Bf16 = cutlass::bfloat16_t;
static_assert(sizeof(Bf16) == sizeof(__nv_bfloat16));

// The tile and schedule of a configuration (see the top of this file).
struct LargeTile {
  using TileMNK = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <int kTileN>
struct SmallTile {
  using TileMNK = cute::Shape<cute::_64, cute::Int<kTileN>, cute::_64>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// ElementC void: no source operand (beta must be 0). Alignments are in elements: 16 bytes.
template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Tile = LargeTile>
struct GroupedGemm {
  using TileMNK = typename Tile::TileMNK;
  static constexpr int kAlignD = 16 / int(sizeof(ElementD));
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileMNK, ClusterMNK,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD, typename Tile::EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, 8, Bf16, LayoutB*, 8, float, TileMNK,
      ClusterMNK,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tile::MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  // Per-expert arguments, written by a setup kernel, read by the GEMM.
  struct Arrays {
    ShapeMNK* shapes;
    const Bf16** a;
    const Bf16** b;
    const ElementC** c;
    ElementD** d;
    StrideA* sa;
    StrideB* sb;
    StrideC* sc;
    StrideD* sd;
  };

  // Carves the arrays for E experts out of one scratch buffer (each array 16-byte aligned).
  static Arrays arrays(DeviceScratch& scratch, int E, const char* op) {
    auto round = [](size_t b) { return (b + 15) / 16 * 16; };
    const size_t n = size_t(E);
    const size_t sizes[] = {round(n * sizeof(ShapeMNK)), round(n * sizeof(void*)),   round(n * sizeof(void*)),
                            round(n * sizeof(void*)),    round(n * sizeof(void*)),   round(n * sizeof(StrideA)),
                            round(n * sizeof(StrideB)),  round(n * sizeof(StrideC)), round(n * sizeof(StrideD))};
    size_t total = 0;
    for (size_t s : sizes) total += s;
    char* p = static_cast<char*>(scratch.get(total, op));
    Arrays g{};
    size_t at = 0;
    auto take = [&](auto*& field, size_t i) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p + at);
      at += sizes[i];
    };
    take(g.shapes, 0);
    take(g.a, 1);
    take(g.b, 2);
    take(g.c, 3);
    take(g.d, 4);
    take(g.sa, 5);
    take(g.sb, 6);
    take(g.sc, 7);
    take(g.sd, 8);
    return g;
  }
};

// A stride with one dynamic mode (the leading dimension) and the unit / batch modes static.
template <class Stride>
__device__ __forceinline__ Stride leading_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<std::remove_cvref_t<decltype(cute::get<0>(s))>>::value)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  return s;
}

// Expert e's rows [r0, r1), or an empty range (and a deferred error) when the offsets are not
// non-decreasing from 0 to R, so that a bad plan never makes the GEMM read or write out of bounds.
__device__ __forceinline__ void expert_rows(const int64_t* off, int e, int E, int64_t R, unsigned long long* err,
                                            int64_t& r0, int64_t& r1) {
  r0 = off[e];
  r1 = off[e + 1];
  const bool ok = 0 <= r0 && r0 <= r1 && r1 <= R && (e != 0 || r0 == 0) && (e != E - 1 || r1 == R);
  if (!ok) {
    const int64_t n = r1 - r0;  // reported as the expert's (clamped) row count
    atomicMin(err, deferred_error_key(e, int32_t(n < INT32_MIN ? INT32_MIN : n > INT32_MAX ? INT32_MAX : n)));
    r0 = r1 = 0;
  }
}

template <class G>
__global__ void rows_setup_kernel(typename G::Arrays g, RowsProblem p, int64_t ldb) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= p.E) return;
  int64_t r0, r1;
  expert_rows(p.off, e, p.E, p.R, p.err, r0, r1);
  g.shapes[e] = cute::make_shape(int(r1 - r0), p.N, p.K);
  g.a[e] = reinterpret_cast<const Bf16*>(p.A + r0 * p.K);
  g.b[e] = reinterpret_cast<const Bf16*>(p.B + int64_t(e) * p.N * p.K);
  g.d[e] = reinterpret_cast<Bf16*>(p.C + r0 * p.N);
  g.sa[e] = leading_stride<typename G::StrideA>(p.K);
  g.sb[e] = leading_stride<typename G::StrideB>(ldb);
  g.sd[e] = leading_stride<typename G::StrideD>(p.N);
}

template <class G>
__global__ void wgrad_setup_kernel(typename G::Arrays g, WgradProblem p) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= p.E) return;
  int64_t r0, r1;
  expert_rows(p.off, e, p.E, p.R, p.err, r0, r1);
  // An expert without rows gets no tiles at all (K = 0 would still make M x N tiles).
  g.shapes[e] = r1 > r0 ? cute::make_shape(p.M, p.N, int(r1 - r0)) : cute::make_shape(0, 0, 0);
  g.a[e] = reinterpret_cast<const Bf16*>(p.A + r0 * p.M);
  g.b[e] = reinterpret_cast<const Bf16*>(p.B + r0 * p.N);
  float* w = p.W + int64_t(e) * p.M * p.N;
  g.c[e] = w;
  g.d[e] = w;
  g.sa[e] = leading_stride<typename G::StrideA>(p.M);
  g.sb[e] = leading_stride<typename G::StrideB>(p.N);
  g.sc[e] = leading_stride<typename G::StrideC>(p.N);
  g.sd[e] = leading_stride<typename G::StrideD>(p.N);
}

inline const char* status_name(cutlass::Status s) {
  return cutlass::cutlassGetStatusString(s);
}

// Launches the grouped GEMM of G over the arrays that the setup kernel (already queued) fills.
template <class G>
void launch_grouped(const char* op, int E, const typename G::Arrays& g, bool with_c, float beta,
                    DeviceScratch& workspace) {
  using Gemm = typename G::Gemm;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = GroupShape{E, g.shapes, nullptr};  // no host shapes: no host sync
  args.mainloop.ptr_A = g.a;
  args.mainloop.dA = g.sa;
  args.mainloop.ptr_B = g.b;
  args.mainloop.dB = g.sb;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  args.epilogue.ptr_C = with_c ? g.c : nullptr;
  args.epilogue.dC = with_c ? g.sc : nullptr;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.sd;
  MT_CUDA_CHECK(op, cudaGetDevice(&args.hw_info.device_id));
  args.hw_info.sm_count = sm_count(op);

  // initialize() also raises the kernel's shared memory limit (a driver call); later calls only
  // rebuild the parameters (TMA descriptors on the host), which keeps stream captures free of it.
  static Gemm gemm;
  static bool initialized = false;
  cutlass::Status st = gemm.can_implement(args);
  MT_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS grouped GEMM cannot run these arguments (", status_name(st),
           ")");
  void* ws = workspace.get(Gemm::get_workspace_size(args), op);
  st = initialized ? gemm.update(args, ws) : gemm.initialize(args, ws, stream());
  MT_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS grouped GEMM initialize failed (", status_name(st), ")");
  initialized = true;
  st = gemm.run(stream());
  MT_CUDA_LAUNCH_CHECK(op);
  MT_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS grouped GEMM launch failed (", status_name(st), ")");
}

template <class G>
void run_rows(const char* op, const RowsProblem& p, int64_t ldb) {
  static DeviceScratch arrays_buf, workspace;
  const typename G::Arrays g = G::arrays(arrays_buf, p.E, op);
  rows_setup_kernel<G><<<blocks_for(p.E, 128), 128, 0, stream()>>>(g, p, ldb);
  MT_CUDA_LAUNCH_CHECK(op);
  launch_grouped<G>(op, p.E, g, false, 0.0f, workspace);
}

template <class G>
void run_wgrad_impl(const char* op, const WgradProblem& p) {
  static DeviceScratch arrays_buf, workspace;
  const typename G::Arrays g = G::arrays(arrays_buf, p.E, op);
  wgrad_setup_kernel<G><<<blocks_for(p.E, 128), 128, 0, stream()>>>(g, p);
  MT_CUDA_LAUNCH_CHECK(op);
  launch_grouped<G>(op, p.E, g, true, p.beta, workspace);
}

}  // namespace mt::cuda::grouped
