// Sharded start-up: the init and the checkpoint loader fill exactly the requested pieces of the flat
// layout with the values the full init / full load produces, and read only those bytes.
#include <gtest/gtest.h>

#include <filesystem>

#include "model/hf_checkpoint.h"
#include "model/params.h"

using namespace mt;

static std::vector<FlatRange> some_pieces(int64_t total) {
  // Unaligned, chunk-straddling pieces, packed back to back in the destination.
  std::vector<FlatRange> r;
  int64_t dst = 0;
  for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 7}, {1000, 4097}, {total / 2 - 3, total / 2 + 900},
                                                              {total - 65, total}}) {
    r.push_back({b, e, dst});
    dst += e - b;
  }
  return r;
}

TEST(ShardedIo, InitOfPiecesEqualsFullInit) {
  ModelConfig c = preset_model_config("tiny");
  c.vocab_size = 300000;  // more than one 1 Mi-element init chunk
  ParamTable t(c);
  Tensor full = Tensor::zeros({t.total()});
  init_weights(c, t, full, 7);
  auto pieces = some_pieces(t.total());
  Tensor dst = Tensor::zeros({pieces.back().dst_offset + pieces.back().end - pieces.back().begin});
  init_weights_ranges(c, t, pieces, dst, 7);
  for (const FlatRange& p : pieces)
    for (int64_t i = p.begin; i < p.end; ++i)
      ASSERT_EQ(dst.data<float>()[p.dst_offset + i - p.begin], full.data<float>()[i]) << "element " << i;
}

TEST(ShardedIo, LoadOfPiecesEqualsFullLoadAndReadsOnlyThoseBytes) {
  ModelConfig c = preset_model_config("tiny");
  ParamTable t(c);
  Tensor full = Tensor::zeros({t.total()});
  init_weights(c, t, full, 3);
  std::string dir = (std::filesystem::temp_directory_path() / "mt_sharded_io").string();
  for (ExpertLayout layout : {ExpertLayout::PerExpert, ExpertLayout::Fused}) {
    save_hf_checkpoint(dir, c, t, full, layout);
    auto pieces = some_pieces(t.total());
    int64_t n = 0;
    for (const FlatRange& p : pieces) n += p.end - p.begin;
    Tensor dst = Tensor::zeros({n});
    LoadReport rep = load_hf_weights_ranges(dir, c, t, pieces, dst);
    EXPECT_EQ(rep.bytes_read, size_t(n) * 4) << expert_layout_name(layout);
    for (const FlatRange& p : pieces)
      for (int64_t i = p.begin; i < p.end; ++i)
        ASSERT_EQ(dst.data<float>()[p.dst_offset + i - p.begin], full.data<float>()[i]) << "element " << i;
  }
  std::filesystem::remove_all(dir);
}
