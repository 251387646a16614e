/* What the fast path (fusefs/_fastpath.h, in the binding fusefs.pyfuse3) offers the native
 * parts that hand it samples, handed over as a capsule (pyfuse3.fast_path_publish_api():
 * FUSEFS_PUBLISH_API): a fetch's worker thread (fusefs/_fetchio.c, read_group) publishes
 * the samples of a group of reads as the group is read (publish), and the cache
 * (fusefs/_cachecore.c, its mirror) tells it of every entry that comes or goes (hold), in
 * C, instead of one Python call a sample (Holders.serve_early, Holders.hand_many,
 * FastPath.hold). */
#ifndef FUSEFS_PUBLISHAPI_H
#define FUSEFS_PUBLISHAPI_H

#include <stddef.h>
#include <stdint.h>

#define FUSEFS_PUBLISH_API "fusefs.pyfuse3.publish_api"
#define FUSEFS_PUBLISH_API_VERSION 2

typedef struct {
    int version; /* FUSEFS_PUBLISH_API_VERSION */
    /* (With the GIL.) A group's fetched, checked samples: sids[i]'s bytes are objs[i], a bytes
     * object (anything else, or NULL, is skipped: a sample whose fetch failed). Where serve[i],
     * the fast path holds them and answers their reads from now on, before fusefs's loop has
     * them (pyfuse3.fast_path_hold); else it does not hold them, and only the reads that wait
     * for them (a miss) are answered (pyfuse3.fast_path_hand). The reads that wait are
     * answered before it returns, with the GIL let go (objs are the caller's references,
     * alive meanwhile). */
    void (*publish)(const int64_t *sids, void *const *objs, const unsigned char *serve, size_t n);
    /* (With the GIL.) The cache's mirror: sid's bytes are obj (a bytes object) from now on,
     * held by the fast path, or none (NULL, or anything else: the fast path lets go of them),
     * as pyfuse3.fast_path_hold. The reads that wait for sid are answered from obj, with the
     * GIL let go (obj is the caller's, alive meanwhile), or, with none, handed to the loop. */
    void (*hold)(uint64_t sid, void *obj);
} fusefs_publish_api;

#endif
