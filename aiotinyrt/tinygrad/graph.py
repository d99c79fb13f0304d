"""TinyJit graphs on AIO: a batch of tinygrad's jitted calls replays as one aiotinyrt graph.

tinygrad hands a graph runner the kernels and copies of a jitted batch once; every later call
of the jitted function calls the runner with that call's input buffers and variable values.
:class:`AIOGraph` records the batch into an aiotinyrt :class:`~aiotinyrt.graph.Graph` (a
capture: the launches and copies are recorded, not run) and replays it with
``graph.replay_with(buffers, vals)``: one queue command per device queue run (on CPU, one
generated C function calling every kernel), the jit's input buffers substituted by name and its
symbolic variables substituted as the launches' int vals.
"""

from __future__ import annotations

from typing import Any

from tinygrad.device import Compiled, MultiBuffer
from tinygrad.engine.jit import MultiGraphRunner
from tinygrad.uop import Ops
from tinygrad.uop.ops import UOp

from aiotinyrt.buffer import Buffer, enqueue_copy
from aiotinyrt.graph import Graph
from aiotinyrt.queue import capturing
from aiotinyrt.tinygrad.sync import run_sync


def _symbolic(dims: Any) -> bool:
    return dims is not None and not all(isinstance(d, (int, float)) for d in dims)


class AIOGraph(MultiGraphRunner):
    """A jitted batch of kernels and copies between ``AIO`` devices as one aiotinyrt graph."""

    def __init__(self, linear: UOp, input_uops: tuple[UOp, ...] = ()) -> None:
        super().__init__(linear, input_uops)
        graph = Graph({})
        #: tinygrad call index -> the graph's command indices (one per ``core_id`` thread)
        self.commands: dict[int, range] = {}
        #: graph input name -> (jit input slot, index in a multi-device input)
        self.inputs: dict[str, tuple[int, int]] = {}
        zero = dict.fromkeys(self.vars, 0)  # captured values; every call substitutes the real ones
        token = capturing.set(graph)
        try:
            for j, ((dev_idx, ast, bufs, device_vars), runtime) in enumerate(
                zip(self.calls, self.runtimes, strict=True)
            ):
                handles = [b._buf for b in bufs]
                for position, slot in self.uop_replace[j]:
                    name = f"in{slot}_{dev_idx}"
                    graph.name(name, handles[position])
                    self.inputs[name] = (slot, dev_idx)
                first = len(graph)
                if ast.op is Ops.PROGRAM:
                    assert runtime is not None  # (an AIOProgram)
                    var_vals = {**zero, **device_vars}
                    global_size, local_size = ast.arg.launch_dims(var_vals)
                    runtime(
                        *handles, global_size=global_size, local_size=local_size, vals=ast.arg.vals(var_vals)
                    )
                else:  # a COPY between AIO devices
                    dest, src = handles
                    enqueue_copy(dest, src)
                self.commands[j] = range(first, len(graph))
        finally:
            capturing.reset(token)
        run_sync(graph._seal)
        self.graph = graph

    @staticmethod
    def supports_uop(batch_devs: list[Compiled], new_call: UOp) -> bool:
        """Kernels and copies of AIO devices, except kernels whose launch size is symbolic (on
        CPU, their thread count: the number of launches would change per call)."""
        ast = new_call.src[0]
        if ast.op is Ops.PROGRAM and _symbolic(ast.arg.global_size):
            return False
        return MultiGraphRunner.supports_uop(batch_devs, new_call)

    def __call__(
        self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait: bool = False
    ) -> float | None:
        """Replay with this call's inputs and variable values; returns at once unless ``wait``
        (then the replay's device seconds, blocking: see :meth:`Signal.wait_blocking`)."""
        buffers: dict[str, Buffer] = {}
        for name, (slot, dev_idx) in self.inputs.items():
            buf = input_uops[slot].buffer
            if isinstance(buf, MultiBuffer):
                buf = buf.bufs[dev_idx]
            buffers[name] = buf.ensure_allocated()._buf
        vals = {(k, i): v for j, i, v in self.updated_vars(var_vals) for k in self.commands[j]}
        sig = self.graph.replay_with(buffers, vals)
        return sig.wait_blocking() if wait else None


__all__ = ["AIOGraph"]
