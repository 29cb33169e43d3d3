/* Process tokens, liveness and bounded waiting. */
#include "internal.h"
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

double shmps_lock_timeout_s = 60.0;

/* SHMPS_TEST_LOCK_TIMEOUT_S (internal.h).  Read once, as the library is loaded (a
 * constructor: before any thread of it runs, so a plain double, only read after). */
__attribute__((constructor)) static void lock_timeout_from_env(void) {
    const char *s = getenv("SHMPS_TEST_LOCK_TIMEOUT_S");
    char *end = NULL;
    double t = s ? strtod(s, &end) : 0.0;
    if (s && end != s && !*end && t > 0.0 && t <= 60.0) shmps_lock_timeout_s = t;
}

uint64_t shmps_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Reads state and start time (field 22) of /proc/PID/stat.  Returns 1 if the
 * process exists, 0 if not; *state and *start are set when it exists. */
static int read_stat(uint32_t pid, char *state, uint64_t *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    /* comm may hold spaces and parentheses: fields resume after the last ')' */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return -1;
    p += 2;
    *state = *p;
    /* after ')' come fields 3..: state is 3, starttime is 22 -> skip 19 spaces */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 1;
}

static uint64_t cached_token;
static pid_t cached_pid;

uint64_t shmps_self_token(void) {
    pid_t pid = getpid();
    /* Plain cache: a process has one token; after fork() the pid differs and the
     * child recomputes its own.  Races between threads write the same value. */
    if (pid != cached_pid || cached_token == 0) {
        char state;
        uint64_t start = 0;
        if (read_stat((uint32_t)pid, &state, &start) != 1) start = 0;
        cached_token = ((uint64_t)(uint32_t)pid << 32) | (start & 0xffffffffull);
        cached_pid = pid;
    }
    return cached_token;
}

/* The inode of this process's PID namespace (/proc/self/ns/pid), 0 if unreadable.  A
 * token's pid and start time are those of the checker's /proc: a process of another
 * PID namespace sharing /dev/shm (a container of the same pod) would look dead, or be
 * another process, and its locks be taken over while it holds them. */
uint64_t shmps_self_pid_ns(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

int shmps_token_alive(uint64_t token) {
    if (token == 0) return 0;
    uint32_t pid = (uint32_t)(token >> 32);
    if (pid == 0) return 0;
    char state = 0;
    uint64_t start = 0;
    int r = read_stat(pid, &state, &start);
    if (r < 0) {  /* /proc unreadable: fall back to kill(0); no reuse check */
        return kill((pid_t)pid, 0) == 0 || errno == EPERM;
    }
    if (r == 0) return 0;
    if (state == 'Z' || state == 'X') return 0; /* killed, not yet reaped */
    return (start & 0xffffffffull) == (token & 0xffffffffull);
}

void shmps_wait_init(shmps_wait_t *w, double timeout_s) {
    /* No clock read here: nearly every lock is free (a stripe lock per 16 KiB of every
     * push), and reading the clock for each was about 1 % of a forwarding bridge.  The
     * wait's time starts at its first clock read, in wait_step, after the spins. */
    w->spins = 0;
    w->timeout_ns = timeout_s < 0 ? UINT64_MAX : (uint64_t)(timeout_s * 1e9);
    w->deadline_ns = 0; /* not started */
    w->next_check_ns = 0;
}

int shmps_wait_step(shmps_wait_t *w, uint64_t holder) {
    w->spins++;
    if (w->spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
        return WAIT_AGAIN;
    }
    if (w->spins < 256) {
        sched_yield();
    } else {
        struct timespec ts = {0, 20000}; /* 20 us */
        nanosleep(&ts, NULL);
    }
    uint64_t now = shmps_now_ns();
    if (w->deadline_ns == 0) { /* the first clock read: the timeout counts from here */
        w->deadline_ns = w->timeout_ns == UINT64_MAX ? UINT64_MAX : now + w->timeout_ns;
        w->next_check_ns = now + 1000000ull; /* first liveness check after 1 ms */
    }
    if (now >= w->next_check_ns) {
        w->next_check_ns = now + 1000000ull;
        if (holder != 0 && !shmps_token_alive(holder)) return WAIT_HOLDER_DEAD;
    }
    if (now >= w->deadline_ns) return SHMPS_E_TIMEOUT;
    return WAIT_AGAIN;
}
