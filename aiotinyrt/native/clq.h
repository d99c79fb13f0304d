/* The completion ring of a CL queue (clq.c), as Python sees it: plain declarations that
   aiotinyrt/native/__init__.py hands to cffi's cdef (no preprocessor lines below this one). */
typedef struct clq clq_t;
clq_t *clq_new(uintptr_t wait, uintptr_t event_info, uintptr_t profiling_info, uintptr_t retain,
               uintptr_t release);
void clq_free(clq_t *q);
int clq_push(clq_t *q, void *event, int64_t tag, int urgent);
int clq_hand(clq_t *q, void *event, int64_t tag, void *obj);
int clq_wait(clq_t *q, int max, int32_t *status, double *seconds, int64_t *tags, void **objs);
void *clq_find(clq_t *q, int64_t tag);
void clq_set_wake(clq_t *q, int64_t wake);
void clq_gating(clq_t *q, void *context, uintptr_t create_user, uintptr_t set_status, long ns);
void *clq_gate(clq_t *q);
void clq_open(clq_t *q);
int clq_gated(clq_t *q);
int64_t clq_claim(clq_t *q, uintptr_t event_address, int64_t tag, long ns);
void clq_unclaim(clq_t *q, int64_t claim);
int clq_claims(clq_t *q);
long clq_push_wakes(clq_t *q);
long clq_claim_wakes(clq_t *q);
int clq_resting(clq_t *q);
int clq_poll(clq_t *q, uintptr_t event_address, int64_t tag, long ns, int64_t claim, int max, int32_t *status,
             double *seconds, int64_t *tags, void **objs);
int clq_polled(clq_t *q);
void clq_reported(clq_t *q);
void clq_close(clq_t *q);
