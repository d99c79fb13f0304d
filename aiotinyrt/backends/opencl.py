"""A thin cffi (ABI mode) binding to the OpenCL ICD loader, ``libOpenCL.so.1``: the calls the CL
backend (:mod:`aiotinyrt.backends.ops_cl`) makes, the constants it uses, error names, and the
device discovery (platforms, then their devices, in the loader's order).

ABI mode needs no compiler and no OpenCL headers at install or run time; cffi releases the GIL
around every call, so a blocking call (a build) on a worker thread never stalls the loop.
"""

from __future__ import annotations

from typing import Any

import cffi

ffi = cffi.FFI()
ffi.cdef("""
typedef int32_t cl_int; typedef uint32_t cl_uint; typedef uint64_t cl_ulong;
typedef struct _cl_platform_id* cl_platform_id; typedef struct _cl_device_id* cl_device_id;
typedef struct _cl_context* cl_context; typedef struct _cl_command_queue* cl_command_queue;
typedef struct _cl_mem* cl_mem; typedef struct _cl_program* cl_program;
typedef struct _cl_kernel* cl_kernel; typedef struct _cl_event* cl_event;
typedef struct { size_t origin; size_t size; } cl_buffer_region;
cl_int clGetPlatformIDs(cl_uint, cl_platform_id*, cl_uint*);
cl_int clGetPlatformInfo(cl_platform_id, cl_uint, size_t, void*, size_t*);
cl_int clGetDeviceIDs(cl_platform_id, cl_ulong, cl_uint, cl_device_id*, cl_uint*);
cl_int clGetDeviceInfo(cl_device_id, cl_uint, size_t, void*, size_t*);
cl_context clCreateContext(const intptr_t*, cl_uint, const cl_device_id*, void*, void*, cl_int*);
cl_int clReleaseContext(cl_context);
cl_command_queue clCreateCommandQueue(cl_context, cl_device_id, cl_ulong, cl_int*);
cl_int clReleaseCommandQueue(cl_command_queue);
cl_int clFlush(cl_command_queue);
cl_int clFinish(cl_command_queue);
cl_mem clCreateBuffer(cl_context, cl_ulong, size_t, void*, cl_int*);
cl_mem clCreateSubBuffer(cl_mem, cl_ulong, cl_uint, const void*, cl_int*);
cl_int clReleaseMemObject(cl_mem);
cl_int clEnqueueWriteBuffer(cl_command_queue, cl_mem, cl_uint, size_t, size_t, const void*,
                            cl_uint, const cl_event*, cl_event*);
cl_int clEnqueueReadBuffer(cl_command_queue, cl_mem, cl_uint, size_t, size_t, void*,
                           cl_uint, const cl_event*, cl_event*);
cl_int clEnqueueCopyBuffer(cl_command_queue, cl_mem, cl_mem, size_t, size_t, size_t,
                           cl_uint, const cl_event*, cl_event*);
cl_program clCreateProgramWithSource(cl_context, cl_uint, const char**, const size_t*, cl_int*);
cl_program clCreateProgramWithBinary(cl_context, cl_uint, const cl_device_id*, const size_t*,
                                     const unsigned char**, cl_int*, cl_int*);
cl_int clBuildProgram(cl_program, cl_uint, const cl_device_id*, const char*, void*, void*);
cl_int clGetProgramBuildInfo(cl_program, cl_device_id, cl_uint, size_t, void*, size_t*);
cl_int clGetProgramInfo(cl_program, cl_uint, size_t, void*, size_t*);
cl_int clReleaseProgram(cl_program);
cl_kernel clCreateKernel(cl_program, const char*, cl_int*);
cl_int clReleaseKernel(cl_kernel);
cl_int clSetKernelArg(cl_kernel, cl_uint, size_t, const void*);
cl_int clEnqueueNDRangeKernel(cl_command_queue, cl_kernel, cl_uint, const size_t*, const size_t*,
                              const size_t*, cl_uint, const cl_event*, cl_event*);
cl_int clEnqueueMarkerWithWaitList(cl_command_queue, cl_uint, const cl_event*, cl_event*);
cl_int clEnqueueBarrierWithWaitList(cl_command_queue, cl_uint, const cl_event*, cl_event*);
cl_event clCreateUserEvent(cl_context, cl_int*);
cl_int clSetUserEventStatus(cl_event, cl_int);
cl_int clSetEventCallback(cl_event, cl_int, void (*)(cl_event, cl_int, void*), void*);
cl_int clWaitForEvents(cl_uint, const cl_event*);
cl_int clGetEventInfo(cl_event, cl_uint, size_t, void*, size_t*);
cl_int clGetEventProfilingInfo(cl_event, cl_uint, size_t, void*, size_t*);
cl_int clReleaseEvent(cl_event);
cl_int clRetainEvent(cl_event);
""")

# constants (cl.h)
PLATFORM_VERSION, PLATFORM_NAME = 0x0901, 0x0902
DEVICE_TYPE_ALL = 0xFFFFFFFF
DEVICE_GLOBAL_MEM_SIZE, DEVICE_MEM_BASE_ADDR_ALIGN = 0x101F, 0x1019
DEVICE_NAME, DRIVER_VERSION, DEVICE_VERSION = 0x102B, 0x102D, 0x102F
MEM_READ_WRITE, MEM_USE_HOST_PTR, MEM_COPY_HOST_PTR = 1 << 0, 1 << 3, 1 << 5
BUFFER_CREATE_TYPE_REGION = 0x1220
QUEUE_PROFILING_ENABLE = 1 << 1
PROGRAM_BINARY_SIZES, PROGRAM_BINARIES, PROGRAM_BUILD_LOG = 0x1165, 0x1166, 0x1183
COMPLETE = 0
EVENT_COMMAND_EXECUTION_STATUS = 0x11D3
PROFILING_COMMAND_START, PROFILING_COMMAND_END = 0x1282, 0x1283
OUT_OF_MEMORY = (-4, -5, -6, -61)  # allocation failure, out of resources / host memory, bad size

_NAMES_1 = (
    "DEVICE_NOT_FOUND DEVICE_NOT_AVAILABLE COMPILER_NOT_AVAILABLE MEM_OBJECT_ALLOCATION_FAILURE "
    "OUT_OF_RESOURCES OUT_OF_HOST_MEMORY PROFILING_INFO_NOT_AVAILABLE MEM_COPY_OVERLAP "
    "IMAGE_FORMAT_MISMATCH IMAGE_FORMAT_NOT_SUPPORTED BUILD_PROGRAM_FAILURE MAP_FAILURE "
    "MISALIGNED_SUB_BUFFER_OFFSET EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST COMPILE_PROGRAM_FAILURE "
    "LINKER_NOT_AVAILABLE LINK_PROGRAM_FAILURE DEVICE_PARTITION_FAILED KERNEL_ARG_INFO_NOT_AVAILABLE"
)
_NAMES_30 = (
    "VALUE DEVICE_TYPE PLATFORM DEVICE CONTEXT QUEUE_PROPERTIES COMMAND_QUEUE HOST_PTR MEM_OBJECT "
    "IMAGE_FORMAT_DESCRIPTOR IMAGE_SIZE SAMPLER BINARY BUILD_OPTIONS PROGRAM PROGRAM_EXECUTABLE "
    "KERNEL_NAME KERNEL_DEFINITION KERNEL ARG_INDEX ARG_VALUE ARG_SIZE KERNEL_ARGS WORK_DIMENSION "
    "WORK_GROUP_SIZE WORK_ITEM_SIZE GLOBAL_OFFSET EVENT_WAIT_LIST EVENT OPERATION GL_OBJECT "
    "BUFFER_SIZE MIP_LEVEL GLOBAL_WORK_SIZE PROPERTY IMAGE_DESCRIPTOR COMPILER_OPTIONS "
    "LINKER_OPTIONS DEVICE_PARTITION_COUNT PIPE_SIZE DEVICE_QUEUE SPEC_ID"
)
ERROR_NAMES: dict[int, str] = {0: "CL_SUCCESS", -1001: "CL_PLATFORM_NOT_FOUND_KHR"}
ERROR_NAMES.update({-1 - i: f"CL_{n}" for i, n in enumerate(_NAMES_1.split())})
ERROR_NAMES.update({-30 - i: f"CL_INVALID_{n}" for i, n in enumerate(_NAMES_30.split())})


class CLError(RuntimeError):
    """An OpenCL call returned an error code: ``code``, its name, and the ``call``."""

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        self.name = ERROR_NAMES.get(code, f"error {code}")
        super().__init__(f"{call} failed: {self.name} ({code})")


def check(code: int, call: str) -> None:
    """Raise :class:`CLError` unless ``code`` is CL_SUCCESS."""
    if code != 0:
        raise CLError(call, code)


_lib: Any = None
_devices: list[tuple[Any, Any]] | None = None


def lib() -> Any:
    """The loaded ICD loader. Raises ``RuntimeError`` naming what is missing."""
    global _lib
    if _lib is None:
        errors = []
        for name in ("libOpenCL.so.1", "libOpenCL.so"):
            try:
                _lib = ffi.dlopen(name)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise RuntimeError(
                "CL: no OpenCL ICD loader (libOpenCL.so.1) could be loaded "
                f"({'; '.join(errors)}): apt-get install -y ocl-icd-libopencl1 pocl-opencl-icd"
            )
    return _lib


def info_str(getter: Any, obj: Any, param: int) -> str:
    """A string property (clGet*Info)."""
    size = ffi.new("size_t*")
    check(getter(obj, param, 0, ffi.NULL, size), "clGetInfo")
    out = ffi.new("char[]", size[0])
    check(getter(obj, param, size[0], out, ffi.NULL), "clGetInfo")
    return str(ffi.string(out).decode(errors="replace"))


def versions(platform: Any, device: Any) -> tuple[str, str, str, str]:
    """The platform's version, the device's name, its driver's version and its own version."""
    cl = lib()
    name, driver, version = (
        info_str(cl.clGetDeviceInfo, device, p) for p in (DEVICE_NAME, DRIVER_VERSION, DEVICE_VERSION)
    )
    return info_str(cl.clGetPlatformInfo, platform, PLATFORM_VERSION), name, driver, version


def devices() -> list[tuple[Any, Any]]:
    """Every ``(platform, device)``, platforms in the loader's order and each one's devices in
    order: ``CL`` is the first, ``CL:1`` the second. Raises ``RuntimeError`` naming what is
    missing (the loader, a platform, a device)."""
    global _devices
    if _devices is None:
        cl = lib()
        n = ffi.new("cl_uint*")
        code = cl.clGetPlatformIDs(0, ffi.NULL, n)
        if code == -1001 or (code == 0 and n[0] == 0):
            raise RuntimeError(
                "CL: the OpenCL ICD loader found no platform (no ICD in /etc/OpenCL/vendors): "
                "apt-get install -y pocl-opencl-icd"
            )
        check(code, "clGetPlatformIDs")
        platforms = ffi.new("cl_platform_id[]", n[0])
        check(cl.clGetPlatformIDs(n[0], platforms, ffi.NULL), "clGetPlatformIDs")
        found = []
        for platform in platforms:
            if cl.clGetDeviceIDs(platform, DEVICE_TYPE_ALL, 0, ffi.NULL, n) != 0 or n[0] == 0:
                continue  # (CL_DEVICE_NOT_FOUND: a platform without devices)
            ids = ffi.new("cl_device_id[]", n[0])
            check(cl.clGetDeviceIDs(platform, DEVICE_TYPE_ALL, n[0], ids, ffi.NULL), "clGetDeviceIDs")
            found += [(platform, d) for d in ids]
        if not found:
            names = ", ".join(info_str(cl.clGetPlatformInfo, p, PLATFORM_NAME) for p in platforms)
            raise RuntimeError(f"CL: no OpenCL device on the platforms found ({names})")
        _devices = found
    return _devices


def create_context(device_ids: Any) -> Any:
    """A context over ``device_ids`` (a ``cl_device_id[1]``), released when dropped."""
    cl, err = lib(), ffi.new("cl_int*")
    context = cl.clCreateContext(ffi.NULL, 1, device_ids, ffi.NULL, ffi.NULL, err)
    check(err[0], "clCreateContext")
    return ffi.gc(context, cl.clReleaseContext)


def sub_buffer(mem: Any, offset: int, nbytes: int) -> Any:
    """The ``nbytes`` of ``mem`` from ``offset`` as a sub-buffer, released when dropped."""
    cl, err = lib(), ffi.new("cl_int*")
    region = ffi.new("cl_buffer_region*", (offset, nbytes))
    sub = cl.clCreateSubBuffer(mem, MEM_READ_WRITE, BUFFER_CREATE_TYPE_REGION, region, err)
    check(err[0], f"clCreateSubBuffer (a view at offset {offset})")
    return ffi.gc(sub, cl.clReleaseMemObject)


class BuildError(CLError):
    """``clBuildProgram`` failed; ``log`` is the build log."""

    def __init__(self, code: int, log: str) -> None:
        super().__init__("clBuildProgram", code)
        self.log = log


def build(context: Any, device_ids: Any, src: str) -> bytes:
    """Build OpenCL C ``src`` for the device of ``device_ids`` (blocking, GIL released) and
    return its binary (``CL_PROGRAM_BINARIES``); :class:`BuildError` with the log on failure."""
    cl, err = lib(), ffi.new("cl_int*")
    text = ffi.new("char[]", src.encode())
    prog = cl.clCreateProgramWithSource(context, 1, ffi.new("char*[1]", [text]), ffi.NULL, err)
    check(err[0], "clCreateProgramWithSource")
    prog = ffi.gc(prog, cl.clReleaseProgram)
    code = cl.clBuildProgram(prog, 1, device_ids, ffi.NULL, ffi.NULL, ffi.NULL)
    if code != 0:

        def log_info(p: Any, what: int, n: int, out: Any, size: Any) -> int:
            return int(cl.clGetProgramBuildInfo(p, device_ids[0], what, n, out, size))

        raise BuildError(code, info_str(log_info, prog, PROGRAM_BUILD_LOG))
    size = ffi.new("size_t*")
    check(cl.clGetProgramInfo(prog, PROGRAM_BINARY_SIZES, 8, size, ffi.NULL), "clGetProgramInfo")
    binary = ffi.new("unsigned char[]", size[0])
    binaries = ffi.new("unsigned char*[1]", [binary])
    check(cl.clGetProgramInfo(prog, PROGRAM_BINARIES, 8, binaries, ffi.NULL), "clGetProgramInfo")
    return bytes(ffi.buffer(binary, size[0]))


def load(context: Any, device_ids: Any, binary: bytes, name: str) -> tuple[Any, Any]:
    """``(program, kernel)`` of kernel ``name`` in a device ``binary``, released when dropped."""
    cl, err = lib(), ffi.new("cl_int*")
    data = ffi.from_buffer("unsigned char[]", binary)
    sizes = ffi.new("size_t[1]", [len(binary)])
    prog = cl.clCreateProgramWithBinary(
        context, 1, device_ids, sizes, ffi.new("unsigned char*[1]", [data]), ffi.NULL, err
    )
    check(err[0], "clCreateProgramWithBinary")
    prog = ffi.gc(prog, cl.clReleaseProgram)
    check(cl.clBuildProgram(prog, 1, device_ids, ffi.NULL, ffi.NULL, ffi.NULL), "clBuildProgram (binary)")
    kernel = cl.clCreateKernel(prog, name.encode(), err)
    check(err[0], f"clCreateKernel({name!r})")
    return prog, ffi.gc(kernel, cl.clReleaseKernel)


def outcome(event: Any, status: int, times: Any) -> tuple[float, BaseException | None]:
    """The device seconds (profiling) and the error of a completed ``event`` whose execution
    status (or the error code of reading it) is ``status``; ``times`` is a ``cl_ulong[2]``."""
    if status < 0:
        return 0.0, CLError("a command's event (execution status)", status)
    cl = lib()
    if (
        cl.clGetEventProfilingInfo(event, PROFILING_COMMAND_START, 8, times, ffi.NULL) == 0
        and cl.clGetEventProfilingInfo(event, PROFILING_COMMAND_END, 8, times + 1, ffi.NULL) == 0
    ):
        return max(0, times[1] - times[0]) * 1e-9, None
    return 0.0, None  # (a marker or a user event has no profiling information)
