/* fusefs's miss engine's interface: what the fast path (fusefs/_fastpath.h, in the binding
 * fusefs.pyfuse3) offers the engine's reader threads (fusefs/_fetchio.c, Misses), handed over
 * as a capsule (pyfuse3.fast_path_miss_api(): FUSEFS_MISS_API). Every function may be called
 * from any thread, without the GIL.
 *
 * A read of the whole of a sample that is neither held nor being fetched waits in the fast
 * path (a miss); while lanes are set (pyfuse3.fast_path_miss_lanes) and the engine is on
 * (pyfuse3.fast_path_miss_engine), the miss is queued on its sample's lane (one a storage
 * node) instead of being told to fusefs's loop. A lane's readers take what is queued (take; a
 * share each where the node is slow), read it, and answer the reads that wait (done, with the bytes), or hand
 * them to the loop (done, NULL: the loop reads the sample as without the engine). */
#ifndef FUSEFS_MISSAPI_H
#define FUSEFS_MISSAPI_H

#include <stddef.h>
#include <stdint.h>

#define FUSEFS_MISS_API "fusefs.pyfuse3.miss_api"
#define FUSEFS_MISS_API_VERSION 2
#define FUSEFS_MISS_LANES 64 /* lanes at most (a lane a node) */

typedef struct {
    int version; /* FUSEFS_MISS_API_VERSION */
    /* Samples queued on lane, up to max (a reader's share where the lane is slow), taken (at
     * least one: it waits for them); read_ns: how long a read of its last batch took on
     * average (0 at its first call). 0 once the engine stops (a reader then ends). */
    size_t (*take)(int lane, uint64_t *out, size_t max, long long read_ns);
    /* The reads that wait for sid answered from its n bytes at buf (not kept), or handed to
     * the loop (buf NULL); sid is no longer being fetched. Nothing once the engine stopped. */
    void (*done)(uint64_t sid, const char *buf, uint64_t n);
} fusefs_miss_api;

#endif
