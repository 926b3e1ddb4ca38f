// host_max_agree: the processes of one host agree on a few int64 values (each one's maximum over them) through a
// shared mapping, without a collective. mfsdp_ext.graphed's ranks decide together, before every replay, whether the
// graph still fits the call (mfsdp_ext/runtime/host_agreement.py).
#pragma once

#include <torch/extension.h>

namespace mfsdp {

// Per-rank layout of the mapping, in int64 words (kAgreeRankWords per rank, cache-line separated): [0] the
// sequence number the rank last published; [8, 16) and [16, 24) the values of even and odd sequence numbers.
constexpr int64_t kAgreeRankWords = 24;
constexpr int64_t kAgreeMaxValues = 8;

// Publish ``values`` (CPU int64, at most kAgreeMaxValues) as this rank's for sequence number ``seq`` (1, 2, ...,
// the same on every rank for one decision), wait until every rank of ``world`` has published ``seq``, and leave in
// ``values`` each value's maximum over the ranks. Raises if some rank has not published it after ``timeout_s``.
void host_max_agree(const at::Tensor& slots, int64_t rank, int64_t world, int64_t seq, const at::Tensor& values,
                    double timeout_s);

}  // namespace mfsdp
