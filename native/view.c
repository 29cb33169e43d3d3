/* view(): the values of all shards of a dense tensor as one read-only array
 * (view(writable=True): read-write, for the torch adapter's parameters).
 *
 * Each shard's values start on a page boundary (offset 4096) and every shard but
 * the last holds a whole number of pages of values, so the shards can be mapped
 * back to back into one reserved address range (MAP_FIXED inside our own
 * PROT_NONE reservation, which nothing else can be using).
 */
#include "internal.h"
#include <sys/mman.h>
#include <unistd.h>

static int map_views(const int *fds, const uint64_t *offs, const uint64_t *lens, uint32_t n,
                     int prot, void **addr, uint64_t *total) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (offs[i] % page) return SHMPS_E_ARG;
        if (i + 1 < n && lens[i] % page) return SHMPS_E_ARG;
        sum += lens[i];
    }
    uint64_t span = (sum + page - 1) / page * page;
    if (span == 0) span = page;
    char *base = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return SHMPS_E_BOUNDS;
    uint64_t pos = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = (lens[i] + page - 1) / page * page;
        if (len == 0) continue;
        void *p = mmap(base + pos, len, prot, MAP_SHARED | MAP_FIXED, fds[i], (off_t)offs[i]);
        if (p == MAP_FAILED) { munmap(base, span); return SHMPS_E_BOUNDS; }
        pos += lens[i];
    }
    *addr = base;
    *total = span;
    return SHMPS_OK;
}

int shmps_view_map(const int *fds, const uint64_t *offs, const uint64_t *lens, uint32_t n,
                   void **addr, uint64_t *total) {
    return map_views(fds, offs, lens, n, PROT_READ, addr, total);
}

int shmps_view_map_rw(const int *fds, const uint64_t *offs, const uint64_t *lens, uint32_t n,
                      void **addr, uint64_t *total) {
    return map_views(fds, offs, lens, n, PROT_READ | PROT_WRITE, addr, total);
}

int shmps_view_unmap(void *addr, uint64_t total) {
    return munmap(addr, total) ? SHMPS_E_ARG : SHMPS_OK;
}
