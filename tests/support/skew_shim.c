/* A host whose wall clock is wrong, for one process and its children (LD_PRELOAD).
 *
 * Offsets CLOCK_REALTIME (and its coarse variant), gettimeofday and time by
 * THROTTLE_TEST_SKEW_S seconds (a float, may be negative). Monotonic clocks are left alone,
 * so sleeps and timed waits (which Python and glibc time on CLOCK_MONOTONIC) stay true, as
 * on a host whose NTP is off. libfaketime fakes those too, which hangs a Celery worker.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long skew_ns(void) {
    static int read = 0;
    static long long ns = 0;
    if (!read) {
        const char *text = getenv("THROTTLE_TEST_SKEW_S");
        ns = text ? (long long)(strtod(text, NULL) * 1e9) : 0;
        read = 1;
    }
    return ns;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *) = NULL;
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int result = real(clock, ts);
    if (result == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns();
        ts->tv_sec = (time_t)(ns / 1000000000LL);
        ts->tv_nsec = (long)(ns % 1000000000LL);
    }
    return result;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    (void)tz;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
