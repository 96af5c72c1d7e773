/* The advantages' two passes over trajectories in C (learner/native.py builds and loads them).
 *
 * torch does each pass as several ops: three bincounts (each checking the ids' min and max
 * first) and the float64 casts between them to sum rewards into cells, then a row gather, a
 * subtraction, a multiplication and an addition to apply each cell's affine map. Here each is
 * one call (the sums: a counting pass, a copying pass and the sums, see below; the map: one
 * loop). The arithmetic is torch's, operation for operation and in the same order (built with
 * -ffp-contract=off, so that no a * b + c becomes a fused multiply-add): both paths give the same
 * bits; tests/learner/test_native.py checks that.
 *
 * Ids are int32 in [0, cells); a function returns 0, or 1 + the position of the first id outside
 * that range, having stopped there (the caller raises: its ids are in range by construction).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Summing straight into the cells is one random read-modify-write per trajectory into three
 * tables (count, sum, sum of squares: 24 bytes a cell; a batch of 125k groups x 5 strata makes
 * 15 MB, past what the caches hold), and each one misses: 11-14 ms for 1M trajectories into cold
 * tables on the 2-core VM, against ~3 ms into 125k cells. So the trajectories are first copied,
 * in order, into buckets of 2^SPAN_BITS cells (a counting pass, then a copying one), and each
 * bucket's cells are zeroed and summed while they sit in L2: ~5 ms in all. Within a cell the
 * additions keep the trajectories' order: the sums are those of one pass in order, bit for bit. */
enum { SPAN_BITS = 12 };

/* Checks every id (0, or 1 + the position of the first bad one), then fills `items` bucket by
 * bucket and `start` with each bucket's first item (start[buckets] = n). */
#define PARTITION(name, item_t, real_t)                                                         \
    static int64_t name(const int32_t *cell, const real_t *reward, int64_t n, int64_t cells,  \
                        item_t *items, int64_t *start) {                                      \
        int64_t buckets = ((cells - 1) >> SPAN_BITS) + 1;                                     \
        for (int64_t i = 0; i < n; i++) {                                                     \
            if (cell[i] < 0 || cell[i] >= cells) return i + 1;                                \
            start[(cell[i] >> SPAN_BITS) + 1] += 1;                                           \
        }                                                                                     \
        for (int64_t b = 0; b < buckets; b++) start[b + 1] += start[b];                       \
        int64_t *next = start + buckets + 1; /* the caller gave 2 * buckets + 1 slots */      \
        memcpy(next, start, buckets * sizeof *next);                                          \
        for (int64_t i = 0; i < n; i++) {                                                     \
            item_t *slot = items + next[cell[i] >> SPAN_BITS]++;                              \
            slot->cell = cell[i], slot->x = reward[i];                                        \
        }                                                                                     \
        return 0;                                                                             \
    }

typedef struct { int32_t cell; float x; } item_f32;
typedef struct { int32_t cell; double x; } item_f64;
PARTITION(partition_f32, item_f32, float)
PARTITION(partition_f64, item_f64, double)

/* Each bucket's range of the output tables, zeroed just before its items are summed into it. */
static void zero(int64_t b, int64_t cells, double **tables, int count, int64_t *counts) {
    int64_t lo = b << SPAN_BITS, hi = lo + ((int64_t)1 << SPAN_BITS);
    hi = hi < cells ? hi : cells;
    memset(counts + lo, 0, (hi - lo) * sizeof *counts);
    for (int t = 0; t < count; t++) memset(tables[t] + lo, 0, (hi - lo) * sizeof **tables);
}

/* Per cell: count, sum and sum of squares of float32 rewards, in float64 (exact for the sum).
 * The outputs need not be zeroed. Returns 0, 1 + the position of a bad id, or -1 when there was
 * no memory for the buckets (nothing summed). */
int64_t cell_sums_f32(const int32_t *cell, const float *reward, int64_t n, int64_t cells,
                      int64_t *count, double *sum, double *squares) {
    int64_t buckets = ((cells - 1) >> SPAN_BITS) + 1, status = -1;
    int64_t *start = calloc(2 * buckets + 1, sizeof *start);
    item_f32 *items = malloc((n ? n : 1) * sizeof *items);
    if (start && items && !(status = partition_f32(cell, reward, n, cells, items, start))) {
        double *tables[] = {sum, squares};
        for (int64_t b = 0; b < buckets; b++) {
            zero(b, cells, tables, 2, count);
            for (int64_t j = start[b]; j < start[b + 1]; j++) {
                int32_t k = items[j].cell;
                double x = items[j].x;
                count[k] += 1, sum[k] += x, squares[k] += x * x;
            }
        }
    }
    free(start), free(items);
    return status;
}

/* The same for float64 rewards, each split into a float32 head and the rest (the tail), which
 * sum apart: an all-equal cell's head / n + tail / n is then its reward exactly. */
int64_t cell_sums_f64(const int32_t *cell, const double *reward, int64_t n, int64_t cells,
                      int64_t *count, double *head, double *tail, double *squares) {
    int64_t buckets = ((cells - 1) >> SPAN_BITS) + 1, status = -1;
    int64_t *start = calloc(2 * buckets + 1, sizeof *start);
    item_f64 *items = malloc((n ? n : 1) * sizeof *items);
    if (start && items && !(status = partition_f64(cell, reward, n, cells, items, start))) {
        double *tables[] = {head, tail, squares};
        for (int64_t b = 0; b < buckets; b++) {
            zero(b, cells, tables, 3, count);
            for (int64_t j = start[b]; j < start[b + 1]; j++) {
                int32_t k = items[j].cell;
                double x = items[j].x, h = (double)(float)x;
                count[k] += 1, head[k] += h, tail[k] += x - h, squares[k] += x * x;
            }
        }
    }
    free(start), free(items);
    return status;
}

/* out[i] = (reward[i] - mean) * slope + offset, with (slope, offset, mean) the row of i's cell in
 * a [cells, 3] table: one read of the row (12 or 24 bytes, mostly one cache line) a trajectory.
 * The rows are read in the trajectories' order, at random in the table, so the row AHEAD
 * trajectories on is asked for early: 1M trajectories into a cold 7.5 MB table took 4.1 ms
 * without, 1.8-2.0 ms with 16-64 ahead, and 4.4 against 5.0 ms warm, in the blend's own flow
 * (the 2-core VM). A prefetch is a hint: an id not yet checked cannot fault there. */
#define AHEAD 32
#define AFFINE(name, real_t)                                                                  \
    int64_t name(const int32_t *cell, const real_t *reward, int64_t n, int64_t cells,        \
                 const real_t *table, real_t *out) {                                         \
        for (int64_t i = 0; i < n; i++) {                                                    \
            int32_t k = cell[i];                                                             \
            if (k < 0 || k >= cells) return i + 1;                                           \
            if (i + AHEAD < n) __builtin_prefetch(table + 3 * (int64_t)cell[i + AHEAD]);     \
            const real_t *row = table + 3 * (int64_t)k;                                      \
            out[i] = row[1] + (reward[i] - row[2]) * row[0];                                 \
        }                                                                                    \
        return 0;                                                                            \
    }
AFFINE(affine_f32, float)
AFFINE(affine_f64, double)
