// Which CUDA graph capture the current stream belongs to. torch tells only whether a stream is capturing; the
// Python layer must also tell one capture from the next (two captures with only replays between them).
#pragma once

#include <cstdint>

namespace mfsdp {

// The id CUDA gives the capture under way on `device`'s current stream (unique in the process); 0 when that
// stream is not capturing, and in a build without CUDA.
uint64_t current_capture_id(int64_t device);

}  // namespace mfsdp
