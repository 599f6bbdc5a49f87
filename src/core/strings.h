// Small string helpers shared by the command line and the config readers.
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace mt {

// Levenshtein distance (insertions, deletions and substitutions of one character each cost 1).
size_t edit_distance(const std::string& a, const std::string& b);

// The names near `key` for a "did you mean": within a small edit distance, containing it or contained in it,
// or a prefix of it ("lrate" -> "lr"); '-' and '_' are the same; nearest first, at most `limit`.
std::vector<std::string> near_names(const std::string& key, const std::vector<std::string>& names, size_t limit = 4);

// A boolean as every command writes it: on/off, true/false, yes/no, 1/0 (any case); nullopt for another word.
std::optional<bool> bool_word(const std::string& v);

}  // namespace mt
