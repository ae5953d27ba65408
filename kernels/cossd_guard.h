/* cossd_guard.h: shared file mappings whose bus errors (a file truncated under the mapping) are contained and counted. */
#ifndef COSSD_GUARD_H
#define COSSD_GUARD_H

#include <stddef.h>
#include <stdint.h>

/* BEGIN CDEF */

/* At most this many guarded mappings at once (two per optimizer namespace, 1,024 namespaces). */
#define COSSD_GUARD_SLOTS 4096

/* Install the SIGBUS handler if it is not the current one (the one it replaces is chained to
 * for faults outside every guarded mapping). 0, or -1 with errno. */
int cossd_guard_install(void);
/* 1 while the guard's handler is the process's SIGBUS handler. */
int cossd_guard_installed(void);
/* Map `length` bytes of `fd` from offset 0, MAP_SHARED, read-write when `writable`, and guard
 * the range; *slot receives its registry slot. NULL with errno on failure (ENOSPC: no slot). */
void *cossd_guard_map(int fd, size_t length, int writable, int *slot);
/* Stop guarding `slot` and unmap its range. */
int cossd_guard_unmap(void *address, size_t length, int slot);
/* Bus errors contained in `slot`'s range so far (each a page now reading as zeros). */
uint64_t cossd_guard_faults(int slot);

/* END CDEF */

#endif /* COSSD_GUARD_H */
