/* The floor under bench/cl.py's CL rows: what PoCL costs with no Python at all, and a stand-in
   for clEnqueueNDRangeKernel that costs nothing, to time aiotinyrt's own share of a launch.

   Built by bench/cl.py into a temporary shared library (cc -O2 -shared -fPIC) and called
   through ctypes, in the benchmark's own process. It opens the ICD loader with dlopen, so it
   needs neither OpenCL's headers nor its development library.

   floor_run(n, m, work_us, k, out): on a context and queue of its own (profiling on, as the
   other rows'), with the rows' kernel `out[0] += 1` on one int:
     out[0]: n launches enqueued back to back, each event released at once (as a pyopencl loop
             drops them), microseconds per launch;
     out[1]: the same n launches to the last one's completion (clFinish), per launch;
     out[2]: the median of m round trips (enqueue, then clWaitForEvents), microseconds, after m
             others (as bench/cl.py's round-trip rows);
     out[3 + 2j], out[4 + 2j] (j < k): out[0] and out[1] again with work_us[j] microseconds of
             other work (the thread spinning on the clock) after each enqueue, as a runtime's own
             bookkeeping between two launches, the spin included (on 2 cores out[3] has read
             more than out[0] + 0.5 us).
   Returns 0, or the first OpenCL error code met (-1000: the loader or an entry point is
   missing; -1001: n < 1 or m < 1). What it made is released either way.

   stub_enqueue: clEnqueueNDRangeKernel's signature; it enqueues nothing and hands back a
   reference to stub_event (set by the caller to a user event already complete, along with
   stub_retain, clRetainEvent's address). Every launch then hands the same event to the ring,
   which real launches never do; the ring's work per event is the same. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef int32_t cl_int;
typedef uint32_t cl_uint;
typedef void *handle;

#define CL_DEVICE_TYPE_ALL 0xFFFFFFFFu
#define CL_QUEUE_PROFILING_ENABLE 2u
#define CL_MEM_READ_WRITE 1u

typedef cl_int (*ref_fn)(handle);
void *stub_event;
ref_fn stub_retain;

cl_int stub_enqueue(handle queue, handle kernel, cl_uint dims, const size_t *offset, const size_t *global,
                    const size_t *local, cl_uint n_waits, handle const *waits, handle *event) {
    (void)queue, (void)kernel, (void)dims, (void)offset, (void)global, (void)local, (void)n_waits, (void)waits;
    stub_retain(stub_event);
    *event = stub_event;
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define LOAD(name)                                                  \
    name##_t name = (name##_t)(uintptr_t)dlsym(loader, #name);      \
    if (!name) return -1000;

typedef cl_int (*clGetPlatformIDs_t)(cl_uint, handle *, cl_uint *);
typedef cl_int (*clGetDeviceIDs_t)(handle, uint64_t, cl_uint, handle *, cl_uint *);
typedef handle (*clCreateContext_t)(const intptr_t *, cl_uint, const handle *, void *, void *, cl_int *);
typedef handle (*clCreateCommandQueue_t)(handle, handle, uint64_t, cl_int *);
typedef handle (*clCreateProgramWithSource_t)(handle, cl_uint, const char **, const size_t *, cl_int *);
typedef cl_int (*clBuildProgram_t)(handle, cl_uint, const handle *, const char *, void *, void *);
typedef handle (*clCreateKernel_t)(handle, const char *, cl_int *);
typedef handle (*clCreateBuffer_t)(handle, uint64_t, size_t, void *, cl_int *);
typedef cl_int (*clSetKernelArg_t)(handle, cl_uint, size_t, const void *);
typedef cl_int (*clEnqueueNDRangeKernel_t)(handle, handle, cl_uint, const size_t *, const size_t *,
                                           const size_t *, cl_uint, handle const *, handle *);
typedef cl_int (*clWaitForEvents_t)(cl_uint, handle const *);
typedef cl_int (*clFinish_t)(handle);
typedef cl_int (*clReleaseEvent_t)(handle);
typedef cl_int (*clReleaseObject_t)(handle);

/* n launches, each followed by `work_us` of spinning: microseconds per launch until the last
   one was enqueued (out[0]) and until it completed (out[1]). */
static cl_int pipelined(clEnqueueNDRangeKernel_t enqueue, clReleaseEvent_t release, clFinish_t finish,
                        handle queue, handle kernel, int n, double work_us, double *out) {
    const size_t global = 1;
    cl_int err = finish(queue);
    double start = now();
    for (int i = 0; i < n && !err; i++) {
        handle event;
        err = enqueue(queue, kernel, 1, NULL, &global, NULL, 0, NULL, &event);
        if (!err) release(event);
        if (work_us > 0)
            for (double until = now() + work_us * 1e-6; now() < until;) continue;
    }
    double enqueued = now();
    cl_int done = finish(queue);
    out[0] = (enqueued - start) / n * 1e6;
    out[1] = (now() - start) / n * 1e6;
    return err ? err : done;
}

int floor_run(int n, int m, const double *work_us, int k, double *out) {
    if (n < 1 || m < 1 || k < 0) return -1001;
    void *loader = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!loader) return -1000;
    LOAD(clGetPlatformIDs)
    LOAD(clGetDeviceIDs)
    LOAD(clCreateContext)
    LOAD(clCreateCommandQueue)
    LOAD(clCreateProgramWithSource)
    LOAD(clBuildProgram)
    LOAD(clCreateKernel)
    LOAD(clCreateBuffer)
    LOAD(clSetKernelArg)
    LOAD(clEnqueueNDRangeKernel)
    LOAD(clWaitForEvents)
    LOAD(clFinish)
    LOAD(clReleaseEvent)
    clReleaseObject_t release_mem = (clReleaseObject_t)(uintptr_t)dlsym(loader, "clReleaseMemObject");
    clReleaseObject_t release_kernel = (clReleaseObject_t)(uintptr_t)dlsym(loader, "clReleaseKernel");
    clReleaseObject_t release_program = (clReleaseObject_t)(uintptr_t)dlsym(loader, "clReleaseProgram");
    clReleaseObject_t release_queue = (clReleaseObject_t)(uintptr_t)dlsym(loader, "clReleaseCommandQueue");
    clReleaseObject_t release_context = (clReleaseObject_t)(uintptr_t)dlsym(loader, "clReleaseContext");
    if (!release_mem || !release_kernel || !release_program || !release_queue || !release_context) return -1000;

    handle platform, device, context = NULL;
    cl_int err = clGetPlatformIDs(1, &platform, NULL);
    if (!err) err = clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, NULL);
    if (!err) context = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    handle queue = err ? NULL : clCreateCommandQueue(context, device, CL_QUEUE_PROFILING_ENABLE, &err);
    const char *source = "__kernel void inc(__global int* out) { out[0] += 1; }";
    handle program = err ? NULL : clCreateProgramWithSource(context, 1, &source, NULL, &err);
    if (!err) err = clBuildProgram(program, 1, &device, NULL, NULL, NULL);
    handle kernel = err ? NULL : clCreateKernel(program, "inc", &err);
    handle mem = err ? NULL : clCreateBuffer(context, CL_MEM_READ_WRITE, 4, NULL, &err);
    if (!err) err = clSetKernelArg(kernel, 0, sizeof mem, &mem);
    double *trips = err ? NULL : malloc((size_t)m * sizeof *trips);
    if (!err && !trips) err = -6; /* CL_OUT_OF_HOST_MEMORY */
    const size_t global = 1;
    if (!err) err = pipelined(clEnqueueNDRangeKernel, clReleaseEvent, clFinish, queue, kernel, n, 0.0, out);
    for (int j = 0; j < k && !err; j++)
        err = pipelined(clEnqueueNDRangeKernel, clReleaseEvent, clFinish, queue, kernel, n, work_us[j], out + 3 + 2 * j);
    for (int i = 0; i < 2 * m && !err; i++) { /* (the first m, right after the launches above, not kept) */
        handle event;
        double start = now();
        err = clEnqueueNDRangeKernel(queue, kernel, 1, NULL, &global, NULL, 0, NULL, &event);
        if (!err) {
            err = clWaitForEvents(1, &event);
            clReleaseEvent(event);
        }
        if (i >= m) trips[i - m] = (now() - start) * 1e6;
    }
    if (!err) {
        qsort(trips, (size_t)m, sizeof *trips, by_value);
        out[2] = trips[m / 2];
    }
    free(trips);
    if (mem) release_mem(mem);
    if (kernel) release_kernel(kernel);
    if (program) release_program(program);
    if (queue) release_queue(queue);
    if (context) release_context(context);
    return err;
}
