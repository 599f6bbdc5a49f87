// The device a run asks for by name: "cpu", "cuda", or "auto" (cuda when the CUDA backend can run here).
#pragma once
#include <string>

#include "core/dtype.h"

namespace mt {

// "cuda" without a visible GPU (or a build without CUDA) is an error that says so; another name is an
// error naming the allowed ones.
Device resolve_device(const std::string& name);

}  // namespace mt
