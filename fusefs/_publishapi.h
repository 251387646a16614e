/* What the fast path (fusefs/_fastpath.h, in the binding fusefs.pyfuse3) offers the native
 * parts that hand it samples, handed over as a capsule (pyfuse3.fast_path_publish_api():
 * FUSEFS_PUBLISH_API): a fetch's worker thread (fusefs/_fetchio.c, read_group) publishes
 * each sample as its read is checked, without the GIL (hold_nogil, hand_nogil), and the cache
 * (fusefs/_cachecore.c, its mirror) tells it of every entry that comes or goes (hold), in
 * C, instead of one Python call a sample (Holders.serve_early, Holders.hand_many,
 * FastPath.hold). */
#ifndef FUSEFS_PUBLISHAPI_H
#define FUSEFS_PUBLISHAPI_H

#include <stddef.h>
#include <stdint.h>

#define FUSEFS_PUBLISH_API "fusefs.pyfuse3.publish_api"
#define FUSEFS_PUBLISH_API_VERSION 3

typedef struct {
    int version; /* FUSEFS_PUBLISH_API_VERSION */
    /* (Any thread, without the GIL: a fetch's worker thread as each read is checked.) Sample
     * sid's bytes are those of obj, a bytes object whose reference the caller took for the
     * fast path (with the GIL, before): the fast path holds them and answers their reads from
     * now on, before fusefs's loop has them (pyfuse3.fast_path_hold), and the reads that
     * waited for sid are answered now from its n bytes at buf (obj's). *old: the object the
     * fast path let go of (NULL: none), or obj itself where it holds nothing (no table): the
     * caller hands it to let_go once it holds the GIL. */
    void (*hold_nogil)(uint64_t sid, void *obj, const char *buf, uint64_t n, void **old);
    /* (Any thread, without the GIL.) The reads that wait for sid (a miss) answered from its n
     * bytes at buf, which the fast path does not hold (pyfuse3.fast_path_hand). */
    void (*hand_nogil)(uint64_t sid, const char *buf, uint64_t n);
    /* (With the GIL.) An object hold_nogil let go of (NULL: nothing): its reference dropped
     * once no reply copies from it. */
    void (*let_go)(void *old);
    /* (With the GIL.) The cache's mirror: sid's bytes are obj (a bytes object) from now on,
     * held by the fast path, or none (NULL, or anything else: the fast path lets go of them),
     * as pyfuse3.fast_path_hold. The reads that wait for sid are answered from obj, with the
     * GIL let go (obj is the caller's, alive meanwhile), or, with none, handed to the loop. */
    void (*hold)(uint64_t sid, void *obj);
} fusefs_publish_api;

#endif
