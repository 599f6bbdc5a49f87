// moetrain tokenize --tokenizer FILE [mode] [options]: one of five modes over a Hugging Face tokenizer.json
// (docs/tokenizer.md):
//   encode (default): each stdin line is a text -> its ids (data/tokenize_lines.h);
//   --decode: each stdin line is ids -> the text;
//   --chat: each stdin line is chat messages -> the Qwen3 template's ids (--text: the rendered text);
//   --bench: encode speed on one thread, one JSON line;
//   --out DIR: the {"text": ...} lines of --file (default stdin) -> token shards (data/documents.h).
// An option that the chosen mode would not read is an error, before any input is read. A summary goes to
// stderr at the end.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/cli_args.h"
#include "core/error.h"
#include "core/options.h"
#include "data/documents.h"
#include "data/tokenize_lines.h"
#include "data/tokenizer.h"

namespace mt {

int tokenize_main(const std::vector<std::string>& args) {
  std::string tokenizer_path, file, out_dir, eos = "auto", bad_lines = "skip";
  bool decode = false, chat = false, do_bench = false;
  int passes = 3;
  int64_t shard_tokens = 100'000'000;
  TokenizeLinesOptions lo;
  cli::Options opt(
      "tokenize", "--tokenizer FILE [--decode | --chat | --bench | --out DIR] [options] < input",
      "Encodes stdin lines to ids (one line of ids per line of text), decodes ids, renders Qwen3 chat messages, "
      "times\nthe tokenizer, or writes token shards for training from {\"text\": ...} lines.");
  opt.add("tokenizer", &tokenizer_path, "a Hugging Face tokenizer.json").var("FILE").required();
  opt.group("mode (encode when none is given)");
  opt.add("decode", &decode, "each stdin line is token ids separated by spaces; prints the text");
  opt.add("chat", &chat,
          "each stdin line is {\"messages\": [...], \"tools\": [...]?} or a messages array; prints the ids of the "
          "Qwen3 chat template's text");
  opt.add("bench", &do_bench, "time encode on one thread and print one JSON line");
  opt.add("out", &out_dir, "write token shards DIR/shard-NNNNN.bin from the {\"text\": ...} lines").var("DIR");
  opt.group("encode and decode");
  opt.add("jsonl", &lo.jsonl, "each text is a JSON string (it can hold newlines and tabs)");
  opt.add("skip-special", &lo.skip_special, "--decode: leave special tokens out of the text");
  opt.group("chat");
  opt.add("text", &lo.text, "print the rendered text as a JSON string instead of its ids");
  opt.add("add-generation-prompt", &lo.chat.add_generation_prompt, "end with the assistant's turn opening");
  opt.custom(
      "enable-thinking", cli::Kind::Bool, "the template's enable_thinking (off: an empty think block)",
      [&](const std::string& v) { lo.chat.enable_thinking = cli::parse_bool("--enable-thinking", v); },
      [&] { return !lo.chat.enable_thinking   ? std::string("unset")
                   : *lo.chat.enable_thinking ? "on"
                                              : "off"; });
  opt.group("bench and shards");
  opt.add("file", &file,
          "--bench: the text, one document per line (default: a built-in mixed text); --out: the "
          "JSONL (default: stdin)")
      .var("FILE");
  opt.add("passes", &passes, "--bench: passes over the text (the first cold)").at_least(1);
  opt.add("eos", &eos,
          "--out: the token after each document: auto (<|endoftext|> when the tokenizer has it), "
          "none, or an id")
      .var("auto|none|ID");
  opt.add("shard-tokens", &shard_tokens, "--out: tokens per shard, about (a shard closes at a document's end)")
      .at_least(1);
  opt.add("bad-lines", &bad_lines, "--out: a malformed line is skipped and reported, or fatal")
      .one_of({"skip", "fail"});
  // The mode, then each option that only some modes read: given to another, it would be ignored.
  const auto mode = [&] {
    return do_bench ? "--bench" : !out_dir.empty() ? "--out" : decode ? "--decode" : chat ? "--chat" : "encode";
  };
  opt.rule([&] {
    if (int(decode) + int(chat) + int(do_bench) > 1) MT_THROW("tokenize: --decode, --chat and --bench are exclusive");
    if (do_bench && !out_dir.empty()) MT_THROW("tokenize: --bench and --out are exclusive");
    const std::pair<const char*, std::vector<std::string>> kReadBy[] = {{"jsonl", {"encode", "--decode"}},
                                                                        {"skip-special", {"--decode"}},
                                                                        {"text", {"--chat"}},
                                                                        {"add-generation-prompt", {"--chat"}},
                                                                        {"enable-thinking", {"--chat"}},
                                                                        {"passes", {"--bench"}},
                                                                        {"file", {"--bench", "--out"}},
                                                                        {"eos", {"--out"}},
                                                                        {"shard-tokens", {"--out"}},
                                                                        {"bad-lines", {"--out"}}};
    const std::string m = mode();
    for (const auto& [flag, modes] : kReadBy) {
      if (!opt.given(flag) || std::find(modes.begin(), modes.end(), m) != modes.end()) continue;
      auto name = [](const std::string& x) { return x == "encode" ? std::string("when encoding") : "with " + x; };
      std::string allowed = name(modes[0]);  // "when encoding or with --decode", "with --bench or --out"
      if (modes.size() > 1) allowed += " or " + (modes[0] == "encode" ? name(modes[1]) : modes[1]);
      MT_THROW("tokenize: --", flag, " is read only ", allowed, "; this run ",
               m == "encode" ? "encodes stdin" : "is " + m, ", which would ignore it\n", opt.usage());
    }
    if (!out_dir.empty() && (decode || chat))
      MT_THROW("tokenize: --out writes shards from {\"text\"} lines; it does not combine with --decode or --chat");
  });
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();

  const Tokenizer tok = Tokenizer::from_file(tokenizer_path);
  if (do_bench) {
    std::printf("%s\n", tokenize_bench(tok, file, passes).dump().c_str());
    return 0;
  }
  if (!out_dir.empty()) {
    int64_t eos_id = -1;
    if (eos == "auto") {
      eos_id = tok.token_to_id("<|endoftext|>");
    } else if (eos != "none") {
      eos_id = parse_flag_number<int64_t>("--eos", eos);
      if (eos_id < 0 || eos_id >= int64_t(tok.vocab_size()))
        MT_THROW("--eos ", eos_id, " is not an id of the tokenizer (0 .. ", tok.vocab_size() - 1, "); or auto, none");
    }
    const auto t0 = std::chrono::steady_clock::now();
    const ShardWriteReport r = jsonl_text_to_shards(file.empty() ? "/dev/stdin" : file, tok, out_dir, eos_id,
                                                    shard_tokens, parse_bad_lines(bad_lines));
    std::fprintf(stderr, "%s\ntokenize: %lld documents, %lld tokens (eos %lld) in %zu %s shard(s) under %s, %.2f s\n",
                 r.jsonl.summary().c_str(), (long long)r.documents, (long long)r.tokens, (long long)eos_id,
                 r.files.size(), r.u16 ? "uint16" : "uint32", out_dir.c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  lo.mode = decode ? LineMode::Decode : chat ? LineMode::Chat : LineMode::Encode;
  const TokenizeLinesReport r = tokenize_lines(tok, std::cin, stdout, lo);
  std::fprintf(stderr, "tokenize: %zu lines, %zu bytes, %zu tokens in %.2f s\n", r.lines, r.bytes, r.tokens, r.seconds);
  return 0;
}

}  // namespace mt
