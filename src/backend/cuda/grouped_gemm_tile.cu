// The tile choice of the rows-grouped GEMMs (grouped_gemm.cuh's RowsTile): host code only, compiled in
// builds with and without CUTLASS so that the choice and its environment switch can be asked anywhere.
#include <cstdlib>
#include <string>

#include "backend/cuda/grouped_gemm.cuh"
#include "core/error.h"

namespace mt::cuda {

namespace {

// MOETRAIN_GROUPED_SMALL, read at every call (cheap) so that a bench or a test can switch tiles.
RowsTile tile_from_env() {
  const char* v = std::getenv("MOETRAIN_GROUPED_SMALL");
  const std::string s = v ? v : "";
  if (s.empty() || s == "auto") return RowsTile::automatic;
  if (s == "0") return RowsTile::large;
  if (s == "1" || s == "64x256") return RowsTile::m64n256;
  if (s == "64x128") return RowsTile::m64n128;
  MT_THROW("MOETRAIN_GROUPED_SMALL (", s, ") must be one of auto, 0 (the 128x256 tile), 1 or 64x256, 64x128");
}

}  // namespace

const char* rows_tile_name(RowsTile tile) {
  switch (tile) {
    case RowsTile::automatic:
      return "automatic";
    case RowsTile::large:
      return "large";
    case RowsTile::m64n256:
      return "m64n256";
    case RowsTile::m64n128:
      return "m64n128";
  }
  return "?";
}

RowsTile grouped_rows_tile(int64_t E, int64_t R, bool b_is_nk, RowsTile tile) {
  if (tile != RowsTile::automatic) {
    MT_CHECK(b_is_nk || tile == RowsTile::large, "grouped GEMM: the ", rows_tile_name(tile),
             " tile runs only the TN product (B_e stored [N, K]); the NN product has the large tile only");
    return tile;
  }
  if (!b_is_nk) return RowsTile::large;
  // The batch-invariant mode (core/determinism.h) needs no tile of its own: every tile sums an element over K in
  // the same order (BK 64 in wgmma k16 steps, no split-K) and rounds it once, so the tiles give the same bits
  // (CudaGroupedGemmSmall.RowsTilesMatchCpuAndLargeTile checks it).
  const RowsTile forced = tile_from_env();
  if (forced != RowsTile::automatic) return forced;
  return R <= kSmallRowsPerExpert * E ? RowsTile::m64n256 : RowsTile::large;
}

}  // namespace mt::cuda
