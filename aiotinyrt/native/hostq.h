/* The native host queue as Python sees it.

   aiotinyrt/native/__init__.py reads this file: its integer #defines become Python constants and
   the rest is handed to cffi's cdef, so everything below the defines is plain declarations cffi
   parses (no other preprocessor lines). `struct hq_view` is the prefix of hq_t (hostq_internal.h)
   that Python reads and writes; hostq_internal.h checks every field's offset against it. */

#define HQ_CHUNK 4096          /* slots per ring chunk */
#define HQ_ELAPSED_SLOTS 16384 /* device times kept per queue (the latest commands); a power of two */
#define HQ_MAX_ARGS 24         /* most arguments a native command takes */
#define K_PY 0                 /* slot kinds: a Python command (the worker returns to Python) */
#define K_NATIVE 1             /* ... a C call */
#define R_PY 1                 /* hq_run's answers: the next command is a Python one */
#define R_WAKE 2               /* ... the command run reached wake_at: Python advances */
#define R_HALTED 4             /* ... the queue is halted: Python fails the command */
#define R_DEPS 8               /* ... a dependency's queue has failures: Python checks them */

struct hq_view {
    int64_t completed;
    int64_t expected;
    double *elapsed;
    char _consumer[40];
    int64_t submitted;
    char _producer[56];
    int64_t wake_at;
    int32_t halted;
    int32_t sleeping;
    int64_t fail_max;
    int32_t remote;
    int32_t deps_ok;
};

hq_t *hq_new(void);
void hq_free(hq_t *q);
int64_t hq_push(hq_t *q, int32_t kind, uintptr_t fn, int32_t nargs, uintptr_t args);
int64_t hq_push_deps(hq_t *q, int32_t kind, uintptr_t fn, int32_t nargs, uintptr_t args,
                     int32_t ndeps, uintptr_t deps);
int hq_run(hq_t *q);
void hq_next(hq_t *q);
int64_t hq_set_wake(hq_t *q, int64_t value);
void hq_complete(hq_t *q, int64_t value);
void hq_note_failure(hq_t *q, int64_t value);
