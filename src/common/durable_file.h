// Small files written so that they survive a crash once the call returns: the metadata files of
// checkpoints (config.json, trainer_state.json, checksum manifests, the shard index).
#pragma once

#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

// Creates (or truncates) `path`, writes all of `text`, fsyncs and closes it. An error names the
// path and the failing call ("write /ckpt/x.json: No space left on device (ENOSPC)"); the file
// may then hold part of `text`, so callers write under a temporary name and rename.
Status WriteFileDurable(const std::string& path, std::string_view text);

// Opens `path` with `flags` (O_RDONLY for a file, O_RDONLY | O_DIRECTORY for a directory, to make
// a rename in it durable) and fsyncs it.
Status FsyncPath(const std::string& path, int flags);

}  // namespace strata
