/* The token arrays' half of Trajectory.validate in one pass (buffers/native.py loads it).
 *
 * numpy checks the same invariants in seven whole-array calls of about 1 us each on 1,000 tokens,
 * most of it call overhead; this loop reads each array once (vectorised: built with -O3) and also
 * finds the trajectory's policy version, which would otherwise be one more call.
 *
 * Returns the oldest policy version among the generated tokens (>= 0) when every invariant holds,
 * else minus the number of the first one broken, in the order buffers/records.py checks them:
 *   1 a loss_mask value other than 0 and 1      2 no generated token (loss_mask all 0)
 *   3 a version below -1                        4 a generated token's version < 0, or an
 *   5 a log-prob NaN, infinite or > 1e-4          observation's other than -1
 * (x <= 1e-4f on a float is x <= 1e-4 on the double: no float lies between the two.)
 */
#include <stdint.h>
#include <math.h>

int64_t check_tokens(const int8_t *mask, const int32_t *versions, const float *logprobs, int64_t n) {
    uint8_t top = 0;
    int32_t lowest = INT32_MAX, mixed = INT32_MAX;
    uint32_t oldest = UINT32_MAX; /* as uint32, an observation's -1 is above every version */
    int bad_logprob = 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t m = (uint8_t)mask[i]; /* a negative int8 reads >= 128 */
        int32_t v = versions[i];
        float x = logprobs[i];
        top = m > top ? m : top;
        lowest = v < lowest ? v : lowest;
        /* With v >= -1: v ^ (m - 1) is v where m is 1 and -v - 1 where m is 0, so it is >= 0
         * everywhere exactly when generated tokens have v >= 0 and observations v == -1. */
        int32_t x_or = v ^ ((int32_t)m - 1);
        mixed = x_or < mixed ? x_or : mixed;
        oldest = (uint32_t)v < oldest ? (uint32_t)v : oldest;
        bad_logprob |= (int)!(x <= 1e-4f) | (int)!(x > -INFINITY); /* NaN fails both */
    }
    if (top > 1) return -1;
    if (top == 0) return -2;
    if (lowest < -1) return -3;
    if (mixed < 0) return -4;
    if (bad_logprob) return -5;
    return (int64_t)oldest;
}
