// The Mixture-of-Experts routing contract shared by the host and CUDA kernels (kernels/moe_host.hpp,
// kernels/moe_cuda.cuh) and by every backend. A token's k routed copies are "assignments",
// numbered a = row * topk + j (j: the token's j-th choice, in descending probability).
//
//   moe_route_forward   probs = softmax(logits) (fp32, per row), lse = logsumexp(logits); the top-k
//                       experts of each row (ties: the lower expert index first) and their gates:
//                       the probabilities themselves, or with `normalize` divided by their sum
//                       (k = 1 with normalize would make every gate 1 and the router untrainable:
//                       refused). routed[e] = assignments to e before any drop; prob_sums[e] =
//                       sum over rows of probs[r, e] (for the load-balancing loss).
//   moe_dispatch_plan   assignments sorted stably by expert (within an expert: by a, i.e. token
//                       order, so with a capacity the earliest tokens are kept, as in Switch);
//                       the first `capacity` of each expert are kept (capacity < 0: all).
//                       slot[a] = position of a among the kept, expert-major (-1: dropped);
//                       source_row[s] = row of the kept assignment at position s;
//                       kept[e] = kept assignments of expert e (their rows are contiguous, in
//                       expert order).
//   gather_rows         dst[i] = src[index[i]] (rows of `cols` elements).
//   moe_combine         out[r] (+)= sum_j gate[r, j] * y[slot[r, j]] over kept j, in fp32, rounded
//                       once (gate == nullptr: weights 1). A row with no kept choice gets 0.
//   moe_combine_backward  dgate[r, j] = <dout[r], y[slot]> (0 for a dropped choice);
//                       dy[slot[r, j]] = gate[r, j] * dout[r].
//   moe_route_backward  dlogits from the gates' gradient through the normalisation and the softmax,
//                       plus two loss terms on the probabilities and logits:
//                         dprobs[r, e] += aux_grad[e]        (load balancing; nullptr: none)
//                         dlogits[r, e] += z_grad * lse[r] * probs[r, e]   (router z-loss)
#pragma once

#include <cstdint>

namespace trellis::kernels {

struct MoeRouteArgs {
  std::int64_t rows = 0;
  std::int64_t experts = 0;
  int topk = 1;
  bool normalize = false;  // gates divided by the sum of the chosen probabilities (k >= 2)
};

}  // namespace trellis::kernels
