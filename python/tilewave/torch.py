"""tilewave.torch: the expert-parallel MoE layer of tilewave on PyTorch tensors.

An engine holds, on the GPU, the tokens x (T, H) bf16, the router's top-k ids (T, k) int32 or
int64 and weights (T, k) fp32, and every rank's local experts in the vLLM / SGLang fused-MoE
layout: w13 (E_local, 2F, H) bf16 with each expert's gate rows first, then its up rows, and
w2 (E_local, H, F) bf16. moe_layer() runs the whole layer of one rank on those tensors in one
collective call (tw_moe_layer_ex: dispatch, GEMM1 + SwiGLU, GEMM2 overlapped with the combine,
the weighted sum), on torch.cuda.current_stream(), and returns out (T, H) bf16. dispatch() and
combine() are the two halves on their own.

Every tensor is checked here, before any pointer reaches C: its type, dtype, rank and shape
against the context's problem, the token count against its capacity, contiguity, device and
16-byte alignment; each failure raises a TilewaveError that is also a TypeError (a wrong type or
dtype) or a ValueError (the rest), naming the argument and the fix. What only the GPU can see
(an expert id out of range or repeated within a token) the library checks on the device, and
every rank fails alike with TW_ERR_EXPERT_ID / TW_ERR_DUPLICATE_EXPERT.

A Context is one rank's tw_context_t with its device plan. It sits on an in-process team
(Team: W ranks in one process on one GPU; Context(...) with no team makes a team of one, world
1) or on an NCCL communicator: Context.from_process_group() creates one from a unique id
broadcast over a torch.distributed process group, through the libnccl this process has loaded
(PyTorch's and tilewave's: the dynamic loader shares one libnccl.so.2 between them); or pass
your own ncclComm_t as nccl_comm=. The context checks that the NCCL in the process is the one
tilewave was built against.

Forward only: the output carries no autograd history. This module imports torch; `import
tilewave` never imports it.
"""

import ctypes
import os

try:
    import torch
    import torch.utils.dlpack
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tilewave.torch needs PyTorch (pip install torch, a CUDA build); the "
                      "planning API (import tilewave) works without it") from e

import tilewave as _tw
from tilewave import TilewaveError, _CPlanSummary, _check, _int32, _load
from tilewave import _runtime as _rt
from tilewave._runtime import (_CContextConfig, _CCombineOptions, _CContextInfo, _CDispatchOptions,
                               _CLayerOptions, _COMBINE_OPTIONS_MAGIC, _CONTEXT_CONFIG_MAGIC,
                               _DATAFLOW_REDUCE, _DISPATCH_OPTIONS_MAGIC, _ERR_NCCL,
                               _LAYER_OPTIONS_MAGIC, _MODES)

__all__ = [
    "Context", "Team", "MoELayer", "moe_layer", "dispatch", "combine", "TensorError",
    "TensorTypeError", "nccl_library_path",
]


class TensorError(TilewaveError, ValueError):
    """A tensor argument has the wrong shape, size, layout, device or alignment (raised before
    any C call: .code is None)."""

    def __init__(self, message, status="TW_ERR_INVALID_ARGUMENT"):
        super().__init__(status, message, None)


class TensorTypeError(TilewaveError, TypeError):
    """An argument is not a tensor, or a tensor has the wrong dtype (raised before any C call)."""

    def __init__(self, message):
        super().__init__("TW_ERR_UNSUPPORTED", message, None)


# ------------------------------------------------------------------------------------------------
# The runtime half of the C API (include/tilewave.h), declared on first use
# ------------------------------------------------------------------------------------------------

_INDEX_TYPES = {torch.int32: 0, torch.int64: 1}  # tw_index_type

_runtime = None


def _lib():
    """libtilewave with the runtime functions declared (the planning ones are declared by
    tilewave itself)."""
    global _runtime
    if _runtime is None:
        _runtime = _rt.declare(_load())
    return _runtime


# ------------------------------------------------------------------------------------------------
# NCCL: the libnccl this process has loaded, and a communicator over a torch process group
# ------------------------------------------------------------------------------------------------

class _NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # NCCL_UNIQUE_ID_BYTES


_nccl = None


def nccl_library_path():
    """Path of the libnccl.so.2 mapped into this process. libtilewave links libnccl.so.2, and so
    does PyTorch's libtorch_cuda: the dynamic loader maps one copy, whichever was loaded first
    (PyTorch's own when torch was imported before tilewave's library was loaded), and both use
    it. The communicator tilewave.torch creates uses that copy too."""
    _lib()  # maps tilewave's libnccl.so.2 when torch has not mapped one already
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[5]).startswith("libnccl.so"):
                    return parts[5]
    except OSError:  # pragma: no cover - not Linux
        pass
    return "libnccl.so.2"


def _nccl_lib():
    global _nccl
    if _nccl is None:
        lib = ctypes.CDLL(nccl_library_path())
        c_int, c_p = ctypes.c_int, ctypes.c_void_p
        for name, res, args in [
                ("ncclGetVersion", c_int, [ctypes.POINTER(c_int)]),
                ("ncclGetUniqueId", c_int, [ctypes.POINTER(_NcclUniqueId)]),
                ("ncclCommInitRank", c_int, [ctypes.POINTER(c_p), c_int, _NcclUniqueId, c_int]),
                ("ncclCommDestroy", c_int, [c_p]),
                ("ncclCommCount", c_int, [c_p, ctypes.POINTER(c_int)]),
                ("ncclCommUserRank", c_int, [c_p, ctypes.POINTER(c_int)]),
                ("ncclGetErrorString", ctypes.c_char_p, [c_int]),
                ("ncclGetLastError", ctypes.c_char_p, [c_p])]:
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        _nccl = lib
    return _nccl


def _nccl_check(what, result, comm=None):
    if result != 0:
        lib = _nccl_lib()
        detail = lib.ncclGetLastError(comm).decode(errors="replace") if comm is not None else ""
        raise TilewaveError("TW_ERR_NCCL", "%s failed: %s%s (%s)" % (
            what, lib.ncclGetErrorString(result).decode(errors="replace"),
            ": " + detail if detail else "", nccl_library_path()), _ERR_NCCL)


def nccl_version():
    """ncclGetVersion() of the libnccl this process has loaded, e.g. 22805 for 2.28.5."""
    v = ctypes.c_int()
    _nccl_check("ncclGetVersion", _nccl_lib().ncclGetVersion(ctypes.byref(v)))
    return v.value


def _global_rank(group, group_rank):
    import torch.distributed as dist
    if group is None or group == dist.group.WORLD:
        return group_rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(group, group_rank)


def _unique_id_from_group(group, device):
    """(unique id, group rank, group size): rank 0 of `group` makes an NCCL unique id and the
    group broadcasts it (collective over the group). The id travels as 128 bytes of a uint8
    tensor the group's backend carries: on `device` for an NCCL backend, else on the CPU."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise TilewaveError("TW_ERR_STATE", "from_process_group: torch.distributed is not "
                            "initialised; call torch.distributed.init_process_group first")
    lib = _nccl_lib()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    uid = _NcclUniqueId()
    if rank == 0:
        _nccl_check("ncclGetUniqueId", lib.ncclGetUniqueId(ctypes.byref(uid)))
    where = torch.device("cuda", device) if "nccl" in str(dist.get_backend(group)) else "cpu"
    buf = torch.tensor(list(ctypes.string_at(ctypes.addressof(uid), 128)), dtype=torch.uint8,
                       device=where)
    dist.broadcast(buf, src=_global_rank(group, 0), group=group)
    ctypes.memmove(ctypes.addressof(uid), bytes(buf.cpu().tolist()), 128)
    return uid, rank, world


def _nccl_comm_from_group(group, device):
    """A new ncclComm_t over `group` (collective over it): the group's unique id, then every
    rank joins with ncclCommInitRank on `device`."""
    uid, rank, world = _unique_id_from_group(group, device)
    comm = ctypes.c_void_p()
    with torch.cuda.device(device):
        _nccl_check("ncclCommInitRank(rank %d of %d)" % (rank, world),
                    _nccl_lib().ncclCommInitRank(ctypes.byref(comm), world, uid, rank))
    return comm.value


# ------------------------------------------------------------------------------------------------
# Teams and contexts
# ------------------------------------------------------------------------------------------------

def _device_index(device):
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise TensorError("device %s: tilewave runs on a CUDA device" % device)
        return device.index if device.index is not None else torch.cuda.current_device()
    return _int32("device", device)


def _need_cuda(who):
    if not torch.cuda.is_available():
        raise TilewaveError("TW_ERR_NO_DEVICE", "%s: torch.cuda.is_available() is False; "
                            "tilewave's contexts need a CUDA GPU (sm_90, Hopper); the planning "
                            "API needs none" % who)


class Team:
    """An in-process team (tw_team_create): world_size ranks in this process on one GPU, each
    driven by its own host thread, each on its own CUDA stream (not the default stream). More
    than 2 ranks need CUDA_DEVICE_MAX_CONNECTIONS = 4 x world_size set before the process's
    first CUDA call. Destroy it (close()) after every context on it."""

    def __init__(self, world_size, device=None):
        _need_cuda("Team")
        self.world_size = _int32("world_size", world_size)
        self.device = _device_index(device)
        h = ctypes.c_void_p()
        _check(_lib().tw_team_create(self.world_size, self.device, ctypes.byref(h)))
        self._h = h

    def close(self):
        if getattr(self, "_h", None) is not None and self._h.value:
            h, self._h = self._h, None
            _check(_lib().tw_team_destroy(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Context:
    """One rank's tilewave context and its device plan, for one MoE layer shape.

    hidden H, ffn F, experts (E_total, over all ranks), top_k and max_tokens (the most tokens a
    call on this rank may carry) fix the shapes every call must have: x (T <= max_tokens, H),
    w13 (E_total / W, 2F, H), w2 (E_total / W, H, F). On:
      * no team, no nccl_comm: a new in-process team of one rank (world 1) on `device`;
      * team=Team(W), rank=r: rank r of an in-process team (call from rank r's thread; every
        rank creates its context at the same time: creation is collective);
      * nccl_comm=<ncclComm_t as an int>: the caller's communicator (borrowed, it must outlive
        the context; world size and rank are read from it); collective over it;
      * Context.from_process_group(group, ...): a communicator of its own over a torch process
        group (owned, destroyed with the context).
    device: a CUDA device index or torch.device (default: torch.cuda.current_device()).
    layer: True (default) allocates what moe_layer needs (hidden must be a multiple of 64);
    False allows dispatch and combine only. sm_budget, timeout_ms, debug_tags, max_comm_ctas:
    tw_context_config's fields (0 / False = the library's defaults). dispatch_capacity > 0: the
    capturable mode (tw_context_config.dispatch_capacity: that many rows per expert and source
    rank, no host read of the counts, so moe_layer, dispatch and combine may run inside
    torch.cuda.graph capture; a token count per captured graph).

    close() frees it; on more than one rank destruction is collective, so call close() on every
    rank (or use `with`); garbage collection closes a world-1 context only."""

    def __init__(self, *, hidden, ffn, experts, top_k, max_tokens, team=None, rank=0,
                 nccl_comm=None, device=None, layer=True, sm_budget=0, timeout_ms=0,
                 debug_tags=False, max_comm_ctas=0, tile_m=0, tile_n=0, dispatch_capacity=0,
                 _owned_comm=None):
        self._h = None
        self._dplan = None
        self._team = None
        self._own_team = False
        self._owned_comm = _owned_comm
        _need_cuda("Context")
        if team is not None and nccl_comm is not None:
            raise TilewaveError("TW_ERR_INVALID_ARGUMENT",
                                "Context: give team or nccl_comm, not both")
        lib = _lib()
        if nccl_comm is not None:
            n, r = ctypes.c_int(), ctypes.c_int()
            comm = ctypes.c_void_p(int(nccl_comm))
            _nccl_check("ncclCommCount", _nccl_lib().ncclCommCount(comm, ctypes.byref(n)), comm)
            _nccl_check("ncclCommUserRank", _nccl_lib().ncclCommUserRank(comm, ctypes.byref(r)),
                        comm)
            world, rank = n.value, r.value
        elif team is not None:
            if not isinstance(team, Team) or team._h is None:
                raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "Context: team must be an open "
                                    "tilewave.torch.Team")
            world, rank = team.world_size, _int32("rank", rank)
            if not 0 <= rank < world:
                raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "Context: rank %d is outside the "
                                    "team's 0..%d" % (rank, world - 1))
            device = team.device
        else:
            world, rank = 1, 0
        self.device = _device_index(device)
        self.problem = _tw.Problem(world_size=world, hidden=hidden, ffn=ffn, experts=experts,
                                   top_k=top_k, max_tokens=max_tokens, tile_m=tile_m, tile_n=tile_n)
        self.problem.validate()  # host-side: the first violation, naming the fix
        self.rank, self.world_size = rank, world
        self.layer = bool(layer)
        self.local_experts = experts // world
        # The reduce dataflow explicitly (dispatch and the layer need it, whatever
        # TW_COMBINE_DATAFLOW says); dispatch = 1 always (layer = 1 implies it).
        cfg = _CContextConfig(ctypes.sizeof(_CContextConfig), _CONTEXT_CONFIG_MAGIC,
                              _tw._API_VERSION, _int32("timeout_ms", timeout_ms),
                              1 if debug_tags else 0, _int32("max_comm_ctas", max_comm_ctas), 0, 0,
                              0, _DATAFLOW_REDUCE, _int32("sm_budget", sm_budget), 1,
                              1 if layer else 0, _int32("dispatch_capacity", dispatch_capacity))
        self.dispatch_capacity = int(dispatch_capacity)
        h = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            if nccl_comm is not None:
                st = lib.tw_context_create(ctypes.byref(self.problem._c()),
                                           ctypes.c_void_p(int(nccl_comm)), ctypes.byref(cfg),
                                           ctypes.byref(h))
            else:
                if team is None:
                    team = Team(1, self.device)
                    self._own_team = True
                self._team = team
                st = lib.tw_context_create_on_team(ctypes.byref(self.problem._c()), team._h, rank,
                                                   ctypes.byref(cfg), ctypes.byref(h))
            try:
                _check(st)
            except TilewaveError as e:
                if self._own_team:
                    team.close()
                    self._team = None
                if e.status == "TW_ERR_NCCL":
                    raise TilewaveError(e.status, "%s. The process runs the NCCL at %s (version "
                                        "%d); rebuild tilewave against it: pip install . -C "
                                        "cmake.define.TW_NCCL_ROOT=<its directory holding include/ "
                                        "and lib/, e.g. the nvidia/nccl package beside torch>"
                                        % (e.message, nccl_library_path(), nccl_version()),
                                        e.code) from None
                raise
            self._h = h
            d = ctypes.c_void_p()
            st = lib.tw_device_plan_create(self._h, ctypes.byref(d))
            if st != 0:
                # Not collective: a device plan fails alike on every rank (same problem), so
                # every rank destroys its context here.
                try:
                    _check(st)
                finally:
                    self.close()
            self._dplan = d
        self._tokens = None  # tokens of the last dispatch (combine's output rows)
        self._rows = None  # rows of the last dispatch's plan
        self._rows_base = None  # the dispatch buffer's device address

    @classmethod
    def from_process_group(cls, group=None, *, device=None, **kw):
        """A context over a new NCCL communicator of `group` (default: the world group),
        collective over it: its rank 0 makes an NCCL unique id, the group broadcasts it, every
        rank joins with ncclCommInitRank on `device` (default: the current CUDA device), through
        the libnccl this process has loaded (nccl_library_path()). The communicator belongs to
        the context and is destroyed after it. kw: as Context (experts is the global count)."""
        _need_cuda("Context.from_process_group")
        dev = _device_index(device)
        comm = _nccl_comm_from_group(group, dev)
        try:
            return cls(nccl_comm=comm, device=dev, _owned_comm=comm, **kw)
        except BaseException:
            _nccl_lib().ncclCommDestroy(ctypes.c_void_p(comm))
            raise

    @classmethod
    def _for_checks(cls, problem, device=0, layer=True):
        """A Context with no C context behind it (its handle is NULL), for tests of the host-side
        checks on machines without a GPU: every check of moe_layer, dispatch and combine runs on
        it as on a real one; a call that passed them all would reach C with a NULL context."""
        self = cls.__new__(cls)
        self._h, self._dplan, self._team, self._own_team, self._owned_comm = (
            ctypes.c_void_p(), ctypes.c_void_p(), None, False, None)
        self.problem, self.device, self.layer = problem, device, layer
        self.rank, self.world_size = 0, problem.world_size
        self.local_experts = problem.experts // problem.world_size
        self.dispatch_capacity = 0
        self._tokens = self._rows = self._rows_base = None
        return self

    # --- state ---------------------------------------------------------------------------------

    def _handle(self):
        if self._h is None:
            raise TilewaveError("TW_ERR_STATE", "the context is closed")
        return self._h

    def info(self):
        """dict of tw_context_info: rank, world_size, device, sm_count, timeout_ms, debug_tags,
        max_comm_ctas, window_bytes, nccl_version, unit_tiles, consumer_copy, dataflow,
        sm_budget, in_process."""
        i = _CContextInfo()
        _check(_lib().tw_context_info_get(self._handle(), ctypes.byref(i)))
        return {name: getattr(i, name) for name, _ in _CContextInfo._fields_}

    def plan_summary(self):
        """The summary (as tilewave.Plan.summary) of the plan the last call made."""
        s = _CPlanSummary()
        _check(_lib().tw_device_plan_summary_get(self._dplan, ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _CPlanSummary._fields_}

    def expert_rows(self):
        """The local experts' rows in the layout of the last call's plan, as three lists
        (row0, rows, real_rows): expert e's rows of the dispatch buffer are
        [row0[e], row0[e] + rows[e]), the first real_rows[e] of them tokens, the rest zero
        padding. What an expert computation between dispatch() and combine() needs."""
        E = self.problem.experts // self.problem.world_size
        arrays = [(ctypes.c_int32 * E)() for _ in range(3)]
        _check(_lib().tw_device_plan_expert_rows(self._dplan, *arrays))
        return tuple(list(a) for a in arrays)

    def check(self):
        """tw_context_check: waits for this rank's last call and agrees with every rank on
        whether a device-side wait failed (collective); raises TilewaveError if one did."""
        _check(_lib().tw_context_check(self._handle()))

    def reset(self):
        """tw_context_reset (collective): usable again after a device-side failure."""
        _check(_lib().tw_context_reset(self._handle()))

    def abort(self):
        """tw_context_abort (not collective): give up on the context; close() it next."""
        _check(_lib().tw_context_abort(self._handle()))

    def close(self):
        """Frees the device plan and the context (collective on more than one rank), then the
        team or communicator the context created."""
        if self._h is not None and not self._h.value:  # Context._for_checks: nothing in C
            self._h = self._dplan = None
        lib = _lib()
        try:
            if self._dplan is not None:
                d, self._dplan = self._dplan, None
                _check(lib.tw_device_plan_destroy(d))
            if self._h is not None:
                h, self._h = self._h, None
                with torch.cuda.device(self.device):
                    _check(lib.tw_context_destroy(h))
        finally:
            if self._own_team and self._team is not None:
                t, self._team = self._team, None
                t.close()
            if self._owned_comm is not None:
                c, self._owned_comm = self._owned_comm, None
                _nccl_check("ncclCommDestroy", _nccl_lib().ncclCommDestroy(ctypes.c_void_p(c)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "world_size", 0) == 1 and getattr(self, "_h", None) is not None:
            try:
                self.close()
            except Exception:
                pass


# ------------------------------------------------------------------------------------------------
# Argument checks (host side, before any pointer reaches C)
# ------------------------------------------------------------------------------------------------

def _tensor(name, t, dtypes, shape, hint=""):
    """Checks t's type, dtype, rank and sizes (None in `shape` = any size); returns its shape."""
    if not isinstance(t, torch.Tensor):
        raise TensorTypeError("%s: expected a torch.Tensor, got %s" % (name, type(t).__name__))
    if t.dtype not in dtypes:
        raise TensorTypeError("%s: dtype %s; tilewave takes %s%s" % (
            name, t.dtype, " or ".join(str(d) for d in dtypes), hint))
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "(%s)" % ", ".join("any" if s is None else str(s) for s in shape)
        raise TensorError("%s: shape %s, expected %s" % (name, tuple(t.shape), want),
                          "TW_ERR_INVALID_SIZE")
    return tuple(t.shape)


def _layout(ctx, *tensors):
    """Contiguity of every (name, tensor, alignment), then their device, then their alignment:
    after every shape check, so that a CPU or meta tensor of a wrong shape is reported for its
    shape, and a non-contiguous one for that."""
    for name, t, _ in tensors:
        if not t.is_contiguous():
            raise TensorError("%s: not contiguous (strides %s); pass %s.contiguous()" % (
                name, tuple(t.stride()), name))
    for name, t, _ in tensors:
        if t.device.type != "cuda" or t.device.index != ctx.device:
            raise TensorError("%s: on %s; the context runs on cuda:%d (move it with "
                              ".to('cuda:%d'))" % (name, t.device, ctx.device, ctx.device))
    for name, t, align in tensors:
        if t.numel() > 0 and t.data_ptr() % align != 0:
            raise TensorError("%s: data at 0x%x is not %d-byte aligned (a view at an odd "
                              "offset?); pass a copy (%s.clone())" % (name, t.data_ptr(), align,
                                                                      name), "TW_ERR_ALIGNMENT")


def _routing_tensors(x, topk_ids, topk_weights):
    return [("x", x, 16), ("topk_ids", topk_ids, topk_ids.element_size()),
            ("topk_weights", topk_weights, 4)]


def _check_context(context, who):
    if not isinstance(context, Context):
        raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "%s: context must be a "
                            "tilewave.torch.Context, got %s" % (who, type(context).__name__))
    if context._h is None:
        raise TilewaveError("TW_ERR_STATE", "%s: the context is closed" % who)


def _check_routing(ctx, x, topk_ids, topk_weights):
    """x (T, H) bf16, topk_ids (T, k) int32/int64, topk_weights (T, k) fp32; returns T."""
    p = ctx.problem
    T, _ = _tensor("x", x, (torch.bfloat16,), (None, p.hidden), " (x.to(torch.bfloat16))")
    _tensor("topk_ids", topk_ids, tuple(_INDEX_TYPES), (T, p.top_k),
            " (the global expert ids of each token)")
    _tensor("topk_weights", topk_weights, (torch.float32,), (T, p.top_k),
            " (topk_weights.float())")
    if T > p.max_tokens:
        raise TensorError("x: %d tokens, more than the context's max_tokens %d; create the "
                          "context with a larger max_tokens or split the batch"
                          % (T, p.max_tokens), "TW_ERR_CAPACITY")
    return T


def _stream(ctx):
    s = torch.cuda.current_stream(ctx.device)
    if ctx.world_size > 1 and ctx._team is not None and s.cuda_stream == 0:
        raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "rank %d of an in-process team runs on the "
                            "default stream, which every rank shares: each rank would wait "
                            "behind the others' waits. Run each rank under `with "
                            "torch.cuda.stream(torch.cuda.Stream())`" % ctx.rank)
    if ctx.dispatch_capacity == 0 and torch.cuda.is_current_stream_capturing():
        raise TilewaveError("TW_ERR_UNSUPPORTED", "the current stream is capturing a CUDA graph; "
                            "the eager layer reads the expert counts on the host and cannot be "
                            "captured; create the Context with dispatch_capacity > 0 for a "
                            "capturable one")
    return s.cuda_stream


def _layer_options(mode, comm_ctas, sm_budget, cls, magic):
    if mode not in _MODES:
        raise TilewaveError("TW_ERR_INVALID_ARGUMENT",
                            "mode %r: give one of %s" % (mode, ", ".join(_MODES)))
    if cls is _CLayerOptions:
        return cls(ctypes.sizeof(cls), magic, _tw._API_VERSION, None, _MODES[mode],
                   _int32("comm_ctas", comm_ctas), _int32("sm_budget", sm_budget))
    return cls(ctypes.sizeof(cls), magic, _tw._API_VERSION, _MODES[mode],
               _int32("comm_ctas", comm_ctas), _int32("sm_budget", sm_budget))


def _out(ctx, out, T):
    """The caller's out, checked, or a new (T, H) bf16 tensor (made after the inputs' checks,
    so that a CPU input is reported as such and not as a failed CUDA allocation)."""
    if out is None:
        return torch.empty((T, ctx.problem.hidden), dtype=torch.bfloat16,
                           device="cuda:%d" % ctx.device)
    _layout(ctx, ("out", out, 16))
    return out


# ------------------------------------------------------------------------------------------------
# The calls
# ------------------------------------------------------------------------------------------------

def moe_layer(x, topk_ids, topk_weights, w13, w2, *, context, out=None, mode="overlap",
              comm_ctas=0, sm_budget=0, dispatch_ctas=0):
    """The whole MoE layer of this rank (tw_moe_layer_ex), COLLECTIVE over the context's ranks:
    every rank calls it, in the same order, with its own tokens.
      x (T, H) bf16, topk_ids (T, k) int32 or int64 global expert ids, topk_weights (T, k) fp32,
      w13 (E_local, 2F, H) bf16 (gate rows first), w2 (E_local, H, F) bf16, all contiguous on
      the context's device; out: (T, H) bf16 to write, or None for a new tensor.
    mode: "overlap" (GEMM2 and the combine overlapped) or "unfused" (same bits); comm_ctas: the
    combine's C (0 = the model's choice); sm_budget: SMs the call may occupy (0 = the
    context's); dispatch_ctas: 0 = the model's choice of GEMM1 beside the dispatch or after it,
    -1 = after it, N > 0 = beside it with the copy on N SMs (same bits). Runs on torch.cuda.current_stream(); blocks the host until this rank's expert
    counts are on it (eager mode). Returns out = sum_j w[t][j] * expert_j(x[t]).
    A check failed here on one rank only leaves the other ranks' call to fail after
    TW_TEAM_TIMEOUT_MS; what the library refuses (a bad expert id) fails on every rank alike."""
    _check_context(context, "moe_layer")
    ctx, p = context, context.problem
    opt = _layer_options(mode, comm_ctas, sm_budget, _CLayerOptions, _LAYER_OPTIONS_MAGIC)
    opt.dispatch_ctas = _int32("dispatch_ctas", dispatch_ctas)
    if not ctx.layer:
        raise TilewaveError("TW_ERR_STATE", "moe_layer: the context was created with layer=False; "
                            "create it with layer=True")
    T = _check_routing(ctx, x, topk_ids, topk_weights)
    E, F, H = ctx.local_experts, p.ffn, p.hidden
    _tensor("w13", w13, (torch.bfloat16,), (E, 2 * F, H), " (w13.to(torch.bfloat16))")
    _tensor("w2", w2, (torch.bfloat16,), (E, H, F), " (w2.to(torch.bfloat16))")
    if out is not None:
        _tensor("out", out, (torch.bfloat16,), (T, H))
    _layout(ctx, *_routing_tensors(x, topk_ids, topk_weights), ("w13", w13, 16), ("w2", w2, 16))
    out = _out(ctx, out, T)
    stream = _stream(ctx)
    ctx._tokens = ctx._rows = None  # the layer replaces the plan: no combine() follows it
    with torch.cuda.device(ctx.device):
        _check(_lib().tw_moe_layer_ex(ctx._h, ctx._dplan, x.data_ptr(), topk_ids.data_ptr(),
                                      _INDEX_TYPES[topk_ids.dtype], topk_weights.data_ptr(), T,
                                      w13.data_ptr(), w2.data_ptr(),
                                      out.data_ptr() if T > 0 else None, ctypes.byref(opt),
                                      stream))
    return out


# A torch tensor over memory the context owns (the dispatch buffer), through DLPack: torch reads
# a DLManagedTensor from a "dltensor" capsule and calls its deleter when the tensor dies. (The
# CUDA array interface would do too, but torch needs numpy for it.)
_KDL_CPU, _KDL_CUDA, _KDL_BFLOAT = 1, 2, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DL_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DL_DELETER)]
_dl_alive = {}  # manager_ctx -> (the DLManagedTensor, its shape array) until torch lets go
_dl_next = [1]
_DL_NAME = b"dltensor"  # the capsule keeps this pointer: a module constant outlives it


@_DL_DELETER
def _dl_delete(managed):
    _dl_alive.pop(managed.contents.manager_ctx, None)


def _wrap_bf16(ptr, shape, device_type, device_id):
    """A bf16 tensor of `shape` over the memory at `ptr` (not owned: the caller keeps it alive
    for as long as the tensor is used)."""
    key = _dl_next[0]
    _dl_next[0] += 1
    dims = (ctypes.c_int64 * len(shape))(*shape)
    m = _DLManagedTensor()
    m.dl_tensor = _DLTensor(ptr, _DLDevice(device_type, device_id), len(shape),
                            _DLDataType(_KDL_BFLOAT, 16, 1), dims, None, 0)
    m.manager_ctx = key
    m.deleter = _dl_delete
    _dl_alive[key] = (m, dims)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new(ctypes.addressof(m), _DL_NAME, None)
    return torch.utils.dlpack.from_dlpack(capsule)


def dispatch(x, topk_ids, topk_weights, *, context, sm_budget=0):
    """The dispatch half (tw_moe_dispatch_ex), COLLECTIVE: every token row written once per
    top-k slot into the expert-input rows of its experts' ranks. Returns this rank's expert
    input, (rows, H) bf16 in the plan's remote-owner-aligned row layout (padding rows zero): a
    view of the context's buffer, valid until the next dispatch or layer call on the context
    (peers write into it then); clone() it to keep it. The per-expert row ranges of that layout
    are not in the public API yet, so what runs on these rows before combine() must treat every
    row alike (combine's own GEMM2 applies each row's expert). Inputs as moe_layer."""
    _check_context(context, "dispatch")
    ctx = context
    opt = _CDispatchOptions(ctypes.sizeof(_CDispatchOptions), _DISPATCH_OPTIONS_MAGIC,
                            _tw._API_VERSION, None, _int32("sm_budget", sm_budget))
    T = _check_routing(ctx, x, topk_ids, topk_weights)
    _layout(ctx, *_routing_tensors(x, topk_ids, topk_weights))
    stream = _stream(ctx)
    lib = _lib()
    rows_ptr = ctypes.c_void_p()
    ctx._tokens = ctx._rows = None  # until this dispatch has succeeded
    with torch.cuda.device(ctx.device):
        _check(lib.tw_moe_dispatch_ex(ctx._h, ctx._dplan, x.data_ptr(), topk_ids.data_ptr(),
                                      _INDEX_TYPES[topk_ids.dtype], topk_weights.data_ptr(), T,
                                      ctypes.byref(rows_ptr), ctypes.byref(opt), stream))
    rows = ctx.plan_summary()["rows"]
    base = ctypes.c_void_p()
    _check(lib.tw_context_dispatch_buffer(ctx._h, ctypes.byref(base), None))
    ctx._tokens, ctx._rows, ctx._rows_base = T, rows, base.value
    return _wrap_bf16(rows_ptr.value or base.value, (rows, ctx.problem.hidden), _KDL_CUDA,
                      ctx.device)


def combine(expert_out, w2, *, context, out=None, mode="overlap", comm_ctas=0, sm_budget=0):
    """The combine half (tw_moe_combine_ex), COLLECTIVE, after dispatch() on the same context:
    GEMM2 of each row with its expert's w2 (E_local, H, F) bf16, overlapped with the return of
    each row to its token's rank, then the owner's weighted sum. expert_out: (rows, F) bf16 in
    the layout dispatch() returned (with F == H, dispatch()'s tensor itself). Returns out
    (T, H) bf16 for the T tokens of the last dispatch."""
    _check_context(context, "combine")
    ctx, p = context, context.problem
    opt = _layer_options(mode, comm_ctas, sm_budget, _CCombineOptions, _COMBINE_OPTIONS_MAGIC)
    if ctx._tokens is None:
        raise TilewaveError("TW_ERR_STATE", "combine: no dispatch() on this context since its "
                            "creation or its last moe_layer(); call dispatch() first")
    T, rows = ctx._tokens, ctx._rows
    _tensor("expert_out", expert_out, (torch.bfloat16,), (rows, p.ffn),
            " (rows of the last dispatch's layout)")
    _tensor("w2", w2, (torch.bfloat16,), (ctx.local_experts, p.hidden, p.ffn),
            " (w2.to(torch.bfloat16))")
    if out is not None:
        _tensor("out", out, (torch.bfloat16,), (T, p.hidden))
    _layout(ctx, ("expert_out", expert_out, 16), ("w2", w2, 16))
    out = _out(ctx, out, T)
    stream = _stream(ctx)
    # A rank whose experts got no rows still joins the collective call, with a valid pointer
    # (the library refuses NULL): the dispatch buffer's, of which the GEMM reads no row.
    src = expert_out.data_ptr() if rows > 0 else ctx._rows_base
    with torch.cuda.device(ctx.device):
        _check(_lib().tw_moe_combine_ex(ctx._h, ctx._dplan, src, w2.data_ptr(),
                                        out.data_ptr() if T > 0 else None, ctypes.byref(opt),
                                        stream))
    return out


class MoELayer(torch.nn.Module):
    """The MoE layer as a module: holds this rank's experts (w13 (E_local, 2F, H), w2
    (E_local, H, F), bf16, on the context's device, as parameters without gradients) and the
    context; forward(x, topk_ids, topk_weights) is moe_layer(). context: an open Context of the
    weights' shapes, or None to create one from them: then top_k and max_tokens are needed,
    experts defaults to E_local x the world size, and process_group (a torch.distributed group)
    selects an NCCL context over it, else an in-process team of one (or team= / rank=). Other
    keywords go to Context. close() frees a context the module created."""

    def __init__(self, w13, w2, *, context=None, top_k=None, max_tokens=None, experts=None,
                 process_group=None, mode="overlap", **context_kw):
        super().__init__()
        _tensor("w13", w13, (torch.bfloat16,), (None, None, None))
        E, F2, H = w13.shape
        if F2 % 2:
            raise TensorError("w13: %d rows per expert; expected 2 x ffn (gate rows, then up rows)"
                              % F2, "TW_ERR_INVALID_SIZE")
        _tensor("w2", w2, (torch.bfloat16,), (E, H, F2 // 2))
        self.w13 = torch.nn.Parameter(w13, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2, requires_grad=False)
        self.mode = mode
        self._own = context is None
        if context is None:
            if top_k is None or max_tokens is None:
                raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "MoELayer: without a context, "
                                    "give top_k and max_tokens")
            kw = dict(hidden=H, ffn=F2 // 2, top_k=top_k, max_tokens=max_tokens, **context_kw)
            if w13.device.type == "cuda":
                kw.setdefault("device", w13.device.index)
            if process_group is not None:
                import torch.distributed as dist
                kw["experts"] = experts or E * dist.get_world_size(process_group)
                context = Context.from_process_group(process_group, **kw)
            else:
                team = context_kw.get("team")
                kw["experts"] = experts or E * (team.world_size if team is not None else 1)
                context = Context(**kw)
        elif not isinstance(context, Context):
            raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "MoELayer: context must be a "
                                "tilewave.torch.Context")
        p = context.problem
        if (context.local_experts, p.ffn, p.hidden) != (E, F2 // 2, H):
            raise TensorError("MoELayer: weights of %d experts, ffn %d, hidden %d; the context is "
                              "for %d local experts, ffn %d, hidden %d" % (
                                  E, F2 // 2, H, context.local_experts, p.ffn, p.hidden),
                              "TW_ERR_INVALID_SIZE")
        self.context = context

    def forward(self, x, topk_ids, topk_weights):
        return moe_layer(x, topk_ids, topk_weights, self.w13, self.w2, context=self.context,
                         mode=self.mode)

    def close(self):
        if self._own and self.context is not None:
            c, self.context = self.context, None
            c.close()

    def extra_repr(self):
        p = self.context.problem if self.context is not None else None
        if p is None:
            return "closed"
        return "hidden=%d, ffn=%d, experts=%d (%d local), top_k=%d, max_tokens=%d, world=%d" % (
            p.hidden, p.ffn, p.experts, self.context.local_experts, p.top_k, p.max_tokens,
            p.world_size)
