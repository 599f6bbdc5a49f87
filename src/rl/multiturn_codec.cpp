// The demo model's turn codec (multiturn_codec.h).
#include "rl/multiturn_codec.h"

#include "core/error.h"
#include "data/char_tokenizer.h"
#include "rl/env/tool_call.h"
#include "rl/prompt_file.h"

namespace mt::rl {

TurnCodec demo_codec() {
  TurnCodec c;
  // The demo model's head has 32 outputs, the char vocabulary fewer: an id past it (which a sampled turn may
  // hold) is written <id N>, which no environment takes for a character.
  c.decode = [](const std::vector<int32_t>& ids) {
    const CharTokenizer tok;
    std::string out;
    for (int32_t id : ids)
      out += id >= 0 && id < CharTokenizer::kVocabSize ? tok.token_str(id) : "<id " + std::to_string(id) + ">";
    return out;
  };
  c.encode = [](const std::vector<EnvObservation>& obs) {
    const CharTokenizer tok;
    std::vector<int32_t> out;
    for (size_t k = 0; k < obs.size(); ++k) {
      const std::string& s = obs[k].content;
      for (size_t i = 0; i < s.size();) {
        bool special = false;
        for (int64_t id : {CharTokenizer::kPad, CharTokenizer::kBos, CharTokenizer::kEos}) {
          const std::string name = tok.token_str(id);
          if (s.compare(i, name.size(), name) == 0) {
            out.push_back(int32_t(id));
            i += name.size();
            special = true;
            break;
          }
        }
        if (special) continue;
        const int64_t id = tok.char_id(s[i]);
        if (id < 0)
          MT_THROW("demo codec: observation ", k, " ('", s, "') has the character '", s[i], "' at ", i,
                   ", which the demo's vocabulary lacks; it has the digits, \"", CharTokenizer::kChars.substr(10),
                   "\" and <pad>, <bos>, <eos>");
        out.push_back(int32_t(id));
        ++i;
      }
    }
    return out;
  };
  c.end_of_turn = {int32_t(CharTokenizer::kEos)};
  return c;
}

TurnCodec chat_codec(const Tokenizer& tok, std::vector<int32_t> end_of_turn) {
  TurnCodec c;
  c.decode = [&tok](const std::vector<int32_t>& ids) { return decode_text(tok, ids); };
  c.encode = [&tok](const std::vector<EnvObservation>& obs) {
    const std::string text = std::string(kAfterTurnEnd) + render_tool_response(obs, ChatOptions{});
    const std::vector<uint32_t> ids = tok.encode(text);
    return std::vector<int32_t>(ids.begin(), ids.end());
  };
  c.end_of_turn = std::move(end_of_turn);
  c.parse_tool_call = [](const std::string& text, std::string* error) { return parse_tool_call(text, error); };
  return c;
}

}  // namespace mt::rl
