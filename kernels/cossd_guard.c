/* cossd_guard.c: shared file mappings whose bus errors (a file truncated under the mapping) are contained and counted. */

/*
 * A store or load through a MAP_SHARED mapping past the end of its file raises SIGBUS, which
 * kills the process. The state copies are such mappings, and anything with access to the
 * backing directory can truncate them. This handler turns a bus error inside a guarded range
 * into a fault record: it maps an anonymous zero page over the faulting page (so the access
 * completes, reading zeros) and counts the fault for that range. The device polls the counts
 * after its reads and kernel runs and refuses the copy, so the zeros are never served.
 *
 * Anything else (a fault outside every guarded range, a signal sent with kill) goes to the
 * handler the guard replaced, called directly: the guard stays installed. Previous default
 * action: the process dies of SIGBUS. Ignored: a sent signal is dropped, a fault is fatal (as
 * the kernel makes an ignored fault).
 *
 * Signal safety: the handler reads the registry and the previous action with atomic loads
 * and calls only mmap, sigaction, pthread_sigmask, sigpending and raise (system calls), and
 * the signal-set helpers. Registration takes a mutex the handler never touches.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cossd_guard.h"

typedef struct {
    uintptr_t start;
    uintptr_t end;
    uint64_t faults;
    int used;
} guard_range;

static guard_range guard_ranges[COSSD_GUARD_SLOTS];
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
/* The action the guard replaced, published whole before the guard is installed: the handler
 * reads guard_previous[guard_previous_index], registration writes the other one. */
static struct sigaction guard_previous[2];
static int guard_previous_index;
static uintptr_t guard_page_size = 4096;

static void guard_handler(int sig, siginfo_t *info, void *context);

static int guard_is_current(void) {
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        return 0;
    }
    return (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == guard_handler;
}

static void guard_die(int sig) {
    /* The default action, as if the guard were not there: the signal is blocked while its
     * handler runs, so raise() leaves it pending and it kills the process on return. */
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    sigaction(sig, &action, NULL);
    raise(sig);
}

static void guard_chain(int sig, siginfo_t *info, void *context) {
    /* Not ours: call whoever had the signal before (Python's faulthandler or signal module, or
     * the default action), leaving the guard installed. */
    const struct sigaction *previous =
        &guard_previous[__atomic_load_n(&guard_previous_index, __ATOMIC_ACQUIRE)];
    int sent = info == NULL || info->si_code <= 0;
    if (!(previous->sa_flags & SA_SIGINFO) && previous->sa_handler == SIG_IGN && sent) {
        return;
    }
    if (!(previous->sa_flags & SA_SIGINFO) &&
        (previous->sa_handler == SIG_DFL || previous->sa_handler == SIG_IGN)) {
        guard_die(sig);
        return;
    }
    sigset_t mask;
    pthread_sigmask(SIG_BLOCK, &previous->sa_mask, &mask);  /* as its own delivery would */
    if (previous->sa_flags & SA_SIGINFO) {
        previous->sa_sigaction(sig, info, context);
    } else {
        previous->sa_handler(sig);
    }
    pthread_sigmask(SIG_SETMASK, &mask, NULL);
    /* A fatal handler (faulthandler) restores the action it replaced, which may be this guard,
     * and raises the signal again to pass it on. Pending for the guard again, it would come
     * back here forever: it gets the default action instead. */
    sigset_t pending;
    if (sigpending(&pending) == 0 && sigismember(&pending, sig) == 1 && guard_is_current()) {
        guard_die(sig);
    }
}

static void guard_handler(int sig, siginfo_t *info, void *context) {
    (void)context;
    int saved_errno = errno;
    if (info != NULL && info->si_code > 0) {  /* a fault of this thread, not kill() */
        uintptr_t address = (uintptr_t)info->si_addr;
        for (int i = 0; i < COSSD_GUARD_SLOTS; i++) {
            guard_range *range = &guard_ranges[i];
            if (!__atomic_load_n(&range->used, __ATOMIC_ACQUIRE)) {
                continue;
            }
            if (address < range->start || address >= range->end) {
                continue;
            }
            void *page = (void *)(address & ~(guard_page_size - 1));
            void *mapped = mmap(page, guard_page_size, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (mapped == MAP_FAILED) {
                break;
            }
            __atomic_add_fetch(&range->faults, 1, __ATOMIC_SEQ_CST);
            errno = saved_errno;
            return;
        }
    }
    guard_chain(sig, info, context);
    errno = saved_errno;
}

int cossd_guard_install(void) {
    pthread_mutex_lock(&guard_lock);
    int rc = 0;
    if (!guard_is_current()) {
        long page = sysconf(_SC_PAGESIZE);
        if (page > 0) {
            guard_page_size = (uintptr_t)page;
        }
        /* The action being replaced is published before the guard replaces it, so a signal
         * at any moment finds a complete one to chain to. */
        int next = 1 - __atomic_load_n(&guard_previous_index, __ATOMIC_ACQUIRE);
        rc = sigaction(SIGBUS, NULL, &guard_previous[next]);
        if (rc == 0) {
            __atomic_store_n(&guard_previous_index, next, __ATOMIC_RELEASE);
            struct sigaction action;
            memset(&action, 0, sizeof(action));
            action.sa_sigaction = guard_handler;
            action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
            sigemptyset(&action.sa_mask);
            rc = sigaction(SIGBUS, &action, NULL);
        }
    }
    pthread_mutex_unlock(&guard_lock);
    return rc;
}

int cossd_guard_installed(void) {
    return guard_is_current();
}

void *cossd_guard_map(int fd, size_t length, int writable, int *slot) {
    if (length == 0 || slot == NULL) {
        errno = EINVAL;
        return NULL;
    }
    if (cossd_guard_install() != 0) {
        return NULL;
    }
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    void *address = mmap(NULL, length, prot, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) {
        return NULL;
    }
    pthread_mutex_lock(&guard_lock);
    int found = -1;
    for (int i = 0; i < COSSD_GUARD_SLOTS; i++) {
        if (!__atomic_load_n(&guard_ranges[i].used, __ATOMIC_ACQUIRE)) {
            found = i;
            break;
        }
    }
    if (found >= 0) {
        guard_ranges[found].start = (uintptr_t)address;
        guard_ranges[found].end = (uintptr_t)address + length;
        __atomic_store_n(&guard_ranges[found].faults, 0, __ATOMIC_SEQ_CST);
        __atomic_store_n(&guard_ranges[found].used, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&guard_lock);
    if (found < 0) {
        munmap(address, length);
        errno = ENOSPC;
        return NULL;
    }
    *slot = found;
    return address;
}

int cossd_guard_unmap(void *address, size_t length, int slot) {
    if (slot >= 0 && slot < COSSD_GUARD_SLOTS) {
        pthread_mutex_lock(&guard_lock);
        __atomic_store_n(&guard_ranges[slot].used, 0, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&guard_lock);
    }
    return munmap(address, length);
}

uint64_t cossd_guard_faults(int slot) {
    if (slot < 0 || slot >= COSSD_GUARD_SLOTS) {
        return 0;
    }
    return __atomic_load_n(&guard_ranges[slot].faults, __ATOMIC_SEQ_CST);
}
