/* What the fast path (fusefs/_fastpath.h, in the binding fusefs.pyfuse3) offers a fetch's
 * worker thread (fusefs/_fetchio.c, read_group), handed over as a capsule
 * (pyfuse3.fast_path_publish_api(): FUSEFS_PUBLISH_API): the samples of a group of reads
 * published where the fast path answers from, in C, as the group is read, instead of one
 * Python call a sample (Holders.serve_early, Holders.hand_many). */
#ifndef FUSEFS_PUBLISHAPI_H
#define FUSEFS_PUBLISHAPI_H

#include <stddef.h>
#include <stdint.h>

#define FUSEFS_PUBLISH_API "fusefs.pyfuse3.publish_api"
#define FUSEFS_PUBLISH_API_VERSION 1

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
} fusefs_publish_api;

#endif
