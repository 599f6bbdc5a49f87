// CharTokenizer: vocabulary layout, round trip and the errors on unknown characters and ids.
#include <gtest/gtest.h>

#include "core/error.h"
#include "data/char_tokenizer.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;

namespace {

}  // namespace

TEST(DataCharTokenizer, VocabularyLayout) {
  CharTokenizer tok;
  EXPECT_LE(tok.vocab_size(), 32);
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  for (char c = '0'; c <= '9'; ++c) EXPECT_EQ(tok.char_id(c), 3 + (c - '0'));
  for (char c : std::string("+= -*\n")) EXPECT_GE(tok.char_id(c), 13) << int(c);
  EXPECT_EQ(tok.char_id('a'), -1);
  // Every id is distinct.
  std::vector<int64_t> ids = tok.encode(CharTokenizer::kChars);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], int64_t(i) + 3);
  EXPECT_EQ(int64_t(ids.size()) + 3, tok.vocab_size());
}

TEST(DataCharTokenizer, RoundTrip) {
  CharTokenizer tok;
  std::string text = "12+345=753\n0-9*8 7.6,5?";
  std::vector<int64_t> ids = tok.encode(text);
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(tok.decode(ids), text);
  std::vector<int64_t> with_special = {1, 4, 13, 5, 14, 6, 2, 0};
  EXPECT_EQ(tok.decode(with_special), "<bos>1+2=3<eos><pad>");
  EXPECT_EQ(tok.decode(with_special, /*skip_special=*/true), "1+2=3");
}

TEST(DataCharTokenizer, UnknownCharacterNamesCharAndPosition) {
  CharTokenizer tok;
  std::string msg = error_of([&] { tok.encode("12+x4"); });
  EXPECT_NE(msg.find("'x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 3"), std::string::npos) << msg;
  msg = error_of([&] { tok.encode("1\t2"); });
  EXPECT_NE(msg.find("'\\t'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
  msg = error_of([&] { tok.decode({3, 40}); });
  EXPECT_NE(msg.find("40"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
  EXPECT_THROW(tok.decode({-1}), Error);
}
