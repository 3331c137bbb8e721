// How many parts a decode's keys are split into (split-K) where too few tasks would keep the
// threads busy: shared by the paged decode kernels (decode_tasks.h) and the varlen kernel
// (varlen_tasks.h), so both split a lone long decode alike.

#ifndef VACPACK_SPLIT_POLICY_H
#define VACPACK_SPLIT_POLICY_H

#include <stdint.h>

// A split of a sequence's keys holds at least this many, so a split's fixed costs (loading
// its queries, writing and merging its partial output) stay small against its reads.
#define MIN_SPLIT_KEYS 256
// Tasks wanted per thread: enough that threads finishing early find more work.
#define TASKS_PER_THREAD 4
#define MAX_SPLITS 64

// How many splits a task's keys get when `num_tasks` tasks share `threads` threads: enough
// tasks for the threads, at least MIN_SPLIT_KEYS keys per split, at most MAX_SPLITS.
static inline int64_t splits_for(int64_t num_keys, int64_t num_tasks, int threads) {
    const int64_t wanted = ((int64_t)threads * TASKS_PER_THREAD + num_tasks - 1) / num_tasks;
    int64_t splits = num_keys / MIN_SPLIT_KEYS;
    splits = splits < wanted ? splits : wanted;
    splits = splits < MAX_SPLITS ? splits : MAX_SPLITS;
    return splits < 1 ? 1 : splits;
}

#endif
