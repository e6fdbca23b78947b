"""tilewave: Python binding (ctypes) of the tilewave C library.

tilewave overlaps the MoE expert down projection (GEMM2) with the combine all-to-all at tile
granularity and picks, with an analytical model, how many SMs the communication side gets. This
module wraps the planning half of the C API, which is pure host code and runs on any machine:
problems and presets, routings (generated, from arrays, from files), per-rank plans with the
model's decision, and the first paper's tensor-parallel selector.

The binding is thin on purpose: every call goes straight to the C function of the same name, no
compilation is needed, and every failing status raises TilewaveError carrying the status name
and the library's detail message (tw_last_error). Arrays may be Python lists (nested or flat) or
numpy arrays when numpy is installed; numpy is never required.

The shared library is found through, in order: the TILEWAVE_LIBRARY environment variable (a
path), the libtilewave.so inside this package (where `pip install .` puts it), one in the
directory holding the package, the build tree of a source checkout (build/libtilewave.so beside
python/), then the dynamic loader's search path.

The GPU half (contexts, the layer, dispatch and combine on torch tensors) is tilewave.torch,
imported only when asked for: `import tilewave` never imports torch.
"""

import ctypes
import ctypes.util
import os
from dataclasses import dataclass, fields, replace

__all__ = [
    "TilewaveError", "Problem", "Routing", "Plan", "Hardware", "presets", "tp_select",
    "version", "status_string", "library_path", "ROUTERS",
]

try:  # optional: accepted as input and offered as output, never required
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None

# ------------------------------------------------------------------------------------------------
# Library loading and errors
# ------------------------------------------------------------------------------------------------

_API_VERSION = 1
_PROBLEM_MAGIC = 0x74775062
_HARDWARE_MAGIC = 0x74774877
_PLAN_CONFIG_MAGIC = 0x7477506C

_lib_handle = None


def _candidate_paths():
    env = os.environ.get("TILEWAVE_LIBRARY")
    if env:
        yield env
        return  # an explicit choice must not silently fall back to another copy
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (here, os.path.dirname(here)):
        yield os.path.join(d, "libtilewave.so")
    # A source checkout: python/tilewave/ beside build/ (scripts/build.sh's directory).
    yield os.path.join(os.path.dirname(os.path.dirname(here)), "build", "libtilewave.so")
    found = ctypes.util.find_library("tilewave")
    if found:
        yield found
    yield "libtilewave.so"


def _load():
    global _lib_handle
    if _lib_handle is not None:
        return _lib_handle
    errors = []
    for path in _candidate_paths():
        if os.sep in path and not os.path.exists(path):
            errors.append("%s: no such file" % path)
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append("%s: %s" % (path, e))
            continue
        _declare(lib)
        _lib_handle = lib
        return lib
    raise OSError("tilewave: cannot load libtilewave.so; install the package with `pip install .` "
                  "from the repository, or set TILEWAVE_LIBRARY to the library's path "
                  "(tried: %s)" % "; ".join(errors))


class TilewaveError(Exception):
    """A tilewave call failed. .status is the status name (e.g. "TW_ERR_TOPK_RANGE"), .code its
    value (None when the binding rejected an argument before calling C) and .message the detail
    (what was wrong and how to fix it)."""

    def __init__(self, status, message, code=None):
        self.status = status
        self.message = message
        self.code = code
        super().__init__("%s: %s" % (status, message))


def status_string(code):
    """"NAME: meaning" of a status code, as tw_status_string gives it."""
    return _load().tw_status_string(int(code)).decode()


def _check(code):
    if code != 0:
        lib = _load()
        name = lib.tw_status_string(code).decode().split(":", 1)[0]
        detail = lib.tw_last_error().decode()
        raise TilewaveError(name, detail, code)


def library_path():
    """Path of the libtilewave.so this package loaded (loading it if needed)."""
    return _load()._name


def version():
    """Library version as "MAJOR.MINOR.PATCH"."""
    v = _load().tw_version()
    return "%d.%d.%d" % (v // 10000, (v // 100) % 100, v % 100)


# ------------------------------------------------------------------------------------------------
# C structs (must match include/tilewave.h; the size/magic/version headers let the library reject
# a mismatch with TW_ERR_CONFIG_VERSION instead of misreading it)
# ------------------------------------------------------------------------------------------------

class _CProblem(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32),
                ("version", ctypes.c_uint32), ("world_size", ctypes.c_int32),
                ("hidden", ctypes.c_int32), ("ffn", ctypes.c_int32), ("experts", ctypes.c_int32),
                ("top_k", ctypes.c_int32), ("max_tokens", ctypes.c_int32),
                ("tile_m", ctypes.c_int32), ("tile_n", ctypes.c_int32), ("dtype", ctypes.c_int)]


class _CRoutingStats(ctypes.Structure):
    _fields_ = [("r_expert", ctypes.c_double), ("total_tokens", ctypes.c_int64),
                ("max_expert_load", ctypes.c_int64), ("min_expert_load", ctypes.c_int64),
                ("max_rank_rows", ctypes.c_int64)]


class _CHardware(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32),
                ("version", ctypes.c_uint32), ("sm_count", ctypes.c_int32),
                ("occ_comp", ctypes.c_int32), ("occ_comm", ctypes.c_int32),
                ("c_max", ctypes.c_int32), ("tile_tflops", ctypes.c_double),
                ("tile_overhead_us", ctypes.c_double), ("link_cta_gbps", ctypes.c_double),
                ("link_peak_gbps", ctypes.c_double), ("link_latency_us", ctypes.c_double),
                ("mem_gbps", ctypes.c_double), ("refetch_exposure", ctypes.c_double),
                ("rho_ref", ctypes.c_double), ("l2_mib", ctypes.c_double),
                ("tile_floor_us", ctypes.c_double), ("tile_m64_share", ctypes.c_double)]


class _CPlanConfig(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32),
                ("version", ctypes.c_uint32), ("comm_ctas", ctypes.c_int32),
                ("coalesce", ctypes.c_int32), ("use_model", ctypes.c_int32),
                ("hardware", ctypes.POINTER(_CHardware)), ("schedule", ctypes.c_int32),
                ("dataflow", ctypes.c_int32), ("sm_budget", ctypes.c_int32)]


class _CPlanSummary(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int32), ("comm_ctas", ctypes.c_int32),
                ("coalesce", ctypes.c_int32), ("rows", ctypes.c_int64),
                ("padding_rows", ctypes.c_int64), ("tiles", ctypes.c_int64),
                ("remote_tiles", ctypes.c_int64), ("bands", ctypes.c_int64),
                ("segments", ctypes.c_int64), ("send_bytes", ctypes.c_int64),
                ("predicted_us", ctypes.c_double), ("sequential_us", ctypes.c_double),
                ("solve_us", ctypes.c_double), ("schedule", ctypes.c_int32),
                ("gemm_us", ctypes.c_double), ("dataflow", ctypes.c_int32),
                ("sm_budget", ctypes.c_int32)]


class _CTpWorkload(ctypes.Structure):
    _fields_ = [("m", ctypes.c_int64), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("splits", ctypes.c_int32), ("ranks", ctypes.c_int32),
                ("experts", ctypes.c_int32), ("expert_rows", ctypes.POINTER(ctypes.c_int64)),
                ("tm", ctypes.c_int32), ("tn", ctypes.c_int32), ("tm_comm", ctypes.c_int32),
                ("tn_comm", ctypes.c_int32)]


def _declare(lib):
    c_int, c_i32, c_p, c_char_p = ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p
    P = ctypes.POINTER
    sigs = {
        "tw_status_string": (c_char_p, [c_int]),
        "tw_last_error": (c_char_p, []),
        "tw_version": (c_int, []),
        "tw_problem_validate": (c_int, [P(_CProblem)]),
        "tw_problem_preset": (c_int, [c_char_p, P(_CProblem)]),
        "tw_preset_count": (c_int, []),
        "tw_preset_name": (c_char_p, [c_int]),
        "tw_routing_create": (c_int, [P(_CProblem), P(c_i32), P(P(c_i32)),
                                      P(P(ctypes.c_float)), P(c_p)]),
        "tw_routing_generate": (c_int, [P(_CProblem), c_int, ctypes.c_double, c_i32,
                                        ctypes.c_uint64, P(c_p)]),
        "tw_routing_read": (c_int, [P(_CProblem), c_char_p, P(c_p)]),
        "tw_routing_write": (c_int, [c_p, c_char_p]),
        "tw_routing_stats_get": (c_int, [c_p, P(_CRoutingStats)]),
        "tw_routing_expert_loads": (c_int, [c_p, P(ctypes.c_int64)]),
        "tw_routing_rank": (c_int, [c_p, c_i32, P(c_i32), P(P(c_i32)), P(P(ctypes.c_float))]),
        "tw_routing_destroy": (c_int, [c_p]),
        "tw_hardware_default": (c_int, [P(_CHardware)]),
        "tw_hardware_read": (c_int, [c_char_p, P(_CHardware)]),
        "tw_hardware_write": (c_int, [P(_CHardware), c_char_p]),
        "tw_plan_create": (c_int, [P(_CProblem), c_p, c_i32, P(_CPlanConfig), P(c_p)]),
        "tw_plan_destroy": (c_int, [c_p]),
        "tw_plan_summary_get": (c_int, [c_p, P(_CPlanSummary)]),
        "tw_plan_predict": (c_int, [c_p, c_i32, c_i32, P(ctypes.c_double)]),
        "tw_tp_select": (c_int, [P(_CTpWorkload), P(_CHardware), P(c_i32),
                                 P(ctypes.c_double)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


# ------------------------------------------------------------------------------------------------
# Array helpers (lists or numpy)
# ------------------------------------------------------------------------------------------------

def _flat(values):
    """Flattens a nested list/tuple or a numpy array into a list of Python numbers."""
    if _np is not None and isinstance(values, _np.ndarray):
        return values.reshape(-1).tolist()
    out = []
    stack = [iter(values)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, (list, tuple)) or (_np is not None and isinstance(v, _np.ndarray)):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


_INT32 = (-2**31, 2**31 - 1)


def _int32(name, v):
    """v as an int that fits a C int32_t; ctypes would silently keep only the low 32 bits."""
    if isinstance(v, bool) or not isinstance(v, int) and not (hasattr(v, "__index__")):
        raise TilewaveError("TW_ERR_INVALID_ARGUMENT", "%s = %r: give an integer" % (name, v))
    v = int(v)
    if not _INT32[0] <= v <= _INT32[1]:
        raise TilewaveError("TW_ERR_INVALID_SIZE",
                            "%s = %d does not fit 32 bits (%d..%d)" % (name, v, *_INT32))
    return v


def _c_array(ctype, values):
    flat = _flat(values)
    if ctype is ctypes.c_int32:
        flat = [_int32("expert id", v) for v in flat]
    return (ctype * max(len(flat), 1))(*flat), len(flat)


def _shaped(flat, cols, as_numpy, dtype):
    if as_numpy:
        if _np is None:
            raise ImportError("tilewave: as_numpy=True needs numpy")
        return _np.array(flat, dtype=dtype).reshape(-1, cols)
    return [list(flat[i:i + cols]) for i in range(0, len(flat), cols)]


# ------------------------------------------------------------------------------------------------
# Problems and presets
# ------------------------------------------------------------------------------------------------

_DTYPES = {"bf16": 0, "fp16": 1}


@dataclass
class Problem:
    """One MoE layer, expert parallel (mirrors tw_problem; see include/tilewave.h).
    tile_m / tile_n = 0 let the library choose; dtype is "bf16" or "fp16"."""
    world_size: int = 1
    hidden: int = 0
    ffn: int = 0
    experts: int = 0
    top_k: int = 0
    max_tokens: int = 0
    tile_m: int = 0
    tile_n: int = 0
    dtype: str = "bf16"

    def _c(self):
        if self.dtype not in _DTYPES:
            raise TilewaveError("TW_ERR_UNSUPPORTED",
                                "dtype %r is not one of %s" % (self.dtype, sorted(_DTYPES)))
        v = {f: _int32(f, getattr(self, f)) for f in ("world_size", "hidden", "ffn", "experts",
                                                      "top_k", "max_tokens", "tile_m", "tile_n")}
        return _CProblem(ctypes.sizeof(_CProblem), _PROBLEM_MAGIC, _API_VERSION,
                         v["world_size"], v["hidden"], v["ffn"], v["experts"], v["top_k"],
                         v["max_tokens"], v["tile_m"], v["tile_n"], _DTYPES[self.dtype])

    def validate(self):
        """Raises TilewaveError naming the first violation; returns self when valid."""
        _check(_load().tw_problem_validate(ctypes.byref(self._c())))
        return self

    @classmethod
    def preset(cls, name, **overrides):
        """A problem from a model preset (hidden, ffn, experts, top_k), e.g.
        Problem.preset("deepseek-v2-lite", world_size=8, max_tokens=4096)."""
        c = Problem()._c()
        _check(_load().tw_problem_preset(name.encode(), ctypes.byref(c)))
        p = cls(world_size=c.world_size, hidden=c.hidden, ffn=c.ffn, experts=c.experts,
                top_k=c.top_k, max_tokens=c.max_tokens, tile_m=c.tile_m, tile_n=c.tile_n)
        names = {f.name for f in fields(cls)}
        for k, v in overrides.items():
            if k not in names:
                raise TypeError("Problem has no field %r" % k)
            setattr(p, k, v)
        return p


def presets():
    """Names of the model presets."""
    lib = _load()
    return [lib.tw_preset_name(i).decode() for i in range(lib.tw_preset_count())]


# ------------------------------------------------------------------------------------------------
# Owned C handles (Routing, Plan)
# ------------------------------------------------------------------------------------------------

class _Owned:
    """A Python object owning one C handle, freed by the C function named _destroy on close(), at
    the end of a with block or when collected. _h stays None when the constructor failed."""
    _destroy = None
    _h = None

    def _handle(self):
        if not self._h:
            raise TilewaveError("TW_ERR_STATE", "this %s was closed" % type(self).__name__)
        return self._h

    def close(self):
        if self._h:
            getattr(_load(), self._destroy)(self._h)
            self._h = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ------------------------------------------------------------------------------------------------
# Routings
# ------------------------------------------------------------------------------------------------

ROUTERS = {"balanced": 0, "moderate_skew": 1, "stress_skew": 2, "target": 3}


class Routing(_Owned):
    """Top-k expert ids and gate weights of every token of every rank (owns a tw_routing_t).
    Build with Routing.generate, Routing.from_arrays or Routing.read."""
    _destroy = "tw_routing_destroy"

    def __init__(self, problem, handle):
        # A copy: the C routing was sized by this problem, and a caller may change theirs later.
        self.problem = replace(problem)
        self._h = ctypes.c_void_p(handle)

    @classmethod
    def generate(cls, problem, router="balanced", tokens_per_rank=None, seed=0, param=0.0):
        """Deterministic routing: every rank holds tokens_per_rank tokens (default: the problem's
        max_tokens). router: "balanced", "moderate_skew", "stress_skew" or "target" (param is
        then the target R_expert >= 1)."""
        if router not in ROUTERS:
            raise TilewaveError("TW_ERR_INVALID_ARGUMENT",
                                "unknown router %r; use one of %s" % (router, sorted(ROUTERS)))
        if tokens_per_rank is None:
            tokens_per_rank = problem.max_tokens
        h = ctypes.c_void_p()
        _check(_load().tw_routing_generate(ctypes.byref(problem._c()), ROUTERS[router],
                                           float(param), _int32("tokens_per_rank", tokens_per_rank), int(seed),
                                           ctypes.byref(h)))
        return cls(problem, h.value)

    @classmethod
    def from_arrays(cls, problem, expert_ids, weights, tokens=None):
        """expert_ids, weights: one entry per rank, each (tokens[r], top_k) as a nested list, a
        flat list or a numpy array. tokens: per-rank counts (default: len / top_k)."""
        W, k = problem.world_size, problem.top_k
        if len(expert_ids) != W or len(weights) != W:
            raise TilewaveError("TW_ERR_INVALID_SIZE", "expert_ids and weights need %d entries "
                                "(one per rank), got %d and %d" % (W, len(expert_ids), len(weights)))
        ids_c, w_c, counts = [], [], []
        for r in range(W):
            ia, ni = _c_array(ctypes.c_int32, expert_ids[r])
            wa, nw = _c_array(ctypes.c_float, weights[r])
            if ni != nw or (k > 0 and ni % k != 0):
                raise TilewaveError("TW_ERR_INVALID_SIZE", "rank %d: %d expert ids and %d weights;"
                                    " both must be tokens x top_k (%d)" % (r, ni, nw, k))
            ids_c.append(ia)
            w_c.append(wa)
            counts.append(ni // k if k > 0 else 0)
        if tokens is not None:
            given = [int(t) for t in _flat(tokens)]
            # The C side reads tokens[r] x top_k entries: more than the arrays hold would be read
            # past their end.
            if len(given) != W or any(t < 0 or t > n for t, n in zip(given, counts)):
                raise TilewaveError("TW_ERR_INVALID_SIZE", "tokens %s: need %d counts (one per "
                                    "rank), each 0..tokens in the arrays %s" % (given, W, counts))
            counts = given
        T = (ctypes.c_int32 * max(W, 1))(*counts)
        I = (ctypes.POINTER(ctypes.c_int32) * max(W, 1))(
            *[ctypes.cast(a, ctypes.POINTER(ctypes.c_int32)) for a in ids_c])
        Wt = (ctypes.POINTER(ctypes.c_float) * max(W, 1))(
            *[ctypes.cast(a, ctypes.POINTER(ctypes.c_float)) for a in w_c])
        h = ctypes.c_void_p()
        _check(_load().tw_routing_create(ctypes.byref(problem._c()), T, I, Wt, ctypes.byref(h)))
        return cls(problem, h.value)

    @classmethod
    def read(cls, problem, path):
        """Reads a routing file (format: docs/routing-format.md)."""
        h = ctypes.c_void_p()
        _check(_load().tw_routing_read(ctypes.byref(problem._c()), os.fsencode(path),
                                       ctypes.byref(h)))
        return cls(problem, h.value)

    def write(self, path):
        _check(_load().tw_routing_write(self._handle(), os.fsencode(path)))

    def stats(self):
        """dict: r_expert, total_tokens, max_expert_load, min_expert_load, max_rank_rows."""
        s = _CRoutingStats()
        _check(_load().tw_routing_stats_get(self._handle(), ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _CRoutingStats._fields_}

    def expert_loads(self, as_numpy=False):
        """Assignments per expert (experts entries)."""
        buf = (ctypes.c_int64 * self.problem.experts)()
        _check(_load().tw_routing_expert_loads(self._handle(), buf))
        return _np.array(buf[:], dtype=_np.int64) if as_numpy and _np is not None else list(buf)

    def _rank(self, r):
        """(tokens, ids, weights) of rank r as tw_routing_rank gives them (C pointers)."""
        n = ctypes.c_int32()
        ids = ctypes.POINTER(ctypes.c_int32)()
        w = ctypes.POINTER(ctypes.c_float)()
        _check(_load().tw_routing_rank(self._handle(), int(r), ctypes.byref(n), ctypes.byref(ids),
                                       ctypes.byref(w)))
        return n.value, ids, w

    def rank(self, r, as_numpy=False):
        """(expert_ids, weights) of rank r, each (tokens, top_k)."""
        n, ids, w = self._rank(r)
        k = self.problem.top_k
        cnt = n * k
        flat_ids = ids[:cnt] if cnt else []
        flat_w = w[:cnt] if cnt else []
        return (_shaped(flat_ids, k, as_numpy, "int32"), _shaped(flat_w, k, as_numpy, "float32"))

    @property
    def tokens(self):
        """Tokens held by each rank."""
        return [self._rank(r)[0] for r in range(self.problem.world_size)]


# ------------------------------------------------------------------------------------------------
# Hardware description
# ------------------------------------------------------------------------------------------------

_HW_FIELDS = [name for name, _ in _CHardware._fields_[3:]]


@dataclass
class Hardware:
    """What the model knows of the machine (mirrors tw_hardware). Hardware.default() gives the
    built-in H200 numbers; Hardware.read(path) loads a `tilewave calibrate` file."""
    sm_count: int = 0
    occ_comp: int = 0
    occ_comm: int = 0
    c_max: int = 0
    tile_tflops: float = 0.0
    tile_overhead_us: float = 0.0
    link_cta_gbps: float = 0.0
    link_peak_gbps: float = 0.0
    link_latency_us: float = 0.0
    mem_gbps: float = 0.0
    refetch_exposure: float = 0.0
    rho_ref: float = 0.0
    l2_mib: float = 0.0
    tile_floor_us: float = 0.0
    tile_m64_share: float = 0.0

    @classmethod
    def _from_c(cls, c):
        return cls(**{n: getattr(c, n) for n in _HW_FIELDS})

    def _c(self):
        c = _CHardware()
        c.size, c.magic, c.version = ctypes.sizeof(_CHardware), _HARDWARE_MAGIC, _API_VERSION
        for n in _HW_FIELDS:
            setattr(c, n, getattr(self, n))
        return c

    @classmethod
    def default(cls):
        c = _CHardware()
        _check(_load().tw_hardware_default(ctypes.byref(c)))
        return cls._from_c(c)

    @classmethod
    def read(cls, path):
        c = _CHardware()
        _check(_load().tw_hardware_read(os.fsencode(path), ctypes.byref(c)))
        return cls._from_c(c)

    def write(self, path):
        _check(_load().tw_hardware_write(ctypes.byref(self._c()), os.fsencode(path)))


# ------------------------------------------------------------------------------------------------
# Plans
# ------------------------------------------------------------------------------------------------

SCHEDULES = {"auto": 0, "remote-first": 1, "expert-major": 2}  # tw_schedule
DATAFLOWS = {"default": 0, "reduce": 1, "add": 2}  # tw_combine_dataflow


class Plan(_Owned):
    """One rank's GEMM2 + combine plan (owns a tw_plan_t). comm_ctas / coalesce: explicit C and
    mgb (None = the model's choice); use_model=False gives the fixed defaults; hardware: a
    Hardware (None = TW_CALIBRATION file if set, else built-in defaults); schedule: "auto" (None:
    env TW_SCHEDULE, else the model's choice), "remote-first" or "expert-major"; dataflow: the
    combine dataflow the model predicts for, "reduce" or "add" (None: env TW_COMBINE_DATAFLOW, else
    reduce); sm_budget: the SMs the call may occupy (None: every SM of the hardware
    description); a rank with nothing to send plans comm_ctas 0 unless comm_ctas is given."""
    _destroy = "tw_plan_destroy"

    def __init__(self, problem, routing, rank, comm_ctas=None, coalesce=None, use_model=True,
                 hardware=None, schedule=None, dataflow=None, sm_budget=None):
        self.problem = replace(problem)  # a copy: the plan was built for this problem
        self.routing = routing  # keeps the routing alive at least as long as the plan
        self.rank = rank
        hw = hardware._c() if hardware is not None else None
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError("schedule %r: give one of %s" % (schedule, ", ".join(SCHEDULES)))
        if dataflow is not None and dataflow not in DATAFLOWS:
            raise ValueError("dataflow %r: give one of %s" % (dataflow, ", ".join(DATAFLOWS)))
        if sm_budget is not None and not 2 <= int(sm_budget) <= 100000:
            raise ValueError("sm_budget %r: give the SMs a call may occupy, 2 or more" % sm_budget)
        cfg = _CPlanConfig(ctypes.sizeof(_CPlanConfig), _PLAN_CONFIG_MAGIC, _API_VERSION,
                           _int32("comm_ctas", comm_ctas or 0), _int32("coalesce", coalesce or 0),
                           1 if use_model else 0,
                           ctypes.pointer(hw) if hw is not None else None,
                           SCHEDULES[schedule or "auto"], DATAFLOWS[dataflow or "default"],
                           _int32("sm_budget", sm_budget or 0))
        h = ctypes.c_void_p()
        _check(_load().tw_plan_create(ctypes.byref(problem._c()), routing._handle(), _int32("rank", rank),
                                      ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h

    @property
    def summary(self):
        """dict: rank, comm_ctas, coalesce, rows, padding_rows, tiles, remote_tiles, bands,
        segments, send_bytes, predicted_us, sequential_us, solve_us, schedule (1 remote-first,
        2 expert-major), gemm_us, dataflow (1 reduce, 2 add), sm_budget."""
        s = _CPlanSummary()
        _check(_load().tw_plan_summary_get(self._handle(), ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _CPlanSummary._fields_}

    def predict(self, comm_ctas, coalesce):
        """The model's time in microseconds for this plan with C = comm_ctas, mgb = coalesce."""
        t = ctypes.c_double()
        _check(_load().tw_plan_predict(self._handle(), int(comm_ctas), int(coalesce),
                                       ctypes.byref(t)))
        return t.value


# ------------------------------------------------------------------------------------------------
# The first paper's tensor-parallel selector
# ------------------------------------------------------------------------------------------------

def tp_select(m, n, k, splits, ranks, expert_rows, tm, tn, tm_comm=None, tn_comm=None,
              hardware=None):
    """Equations (2)-(18): returns (best C, [T(C) for C = 1..c_max] in compute waves).
    expert_rows: M_e per local expert (list or numpy); tm_comm/tn_comm default to tm/tn."""
    rows, ne = _c_array(ctypes.c_int64, expert_rows)
    wl = _CTpWorkload(int(m), int(n), int(k), int(splits), int(ranks), ne,
                      ctypes.cast(rows, ctypes.POINTER(ctypes.c_int64)), int(tm), int(tn),
                      int(tm if tm_comm is None else tm_comm), int(tn if tn_comm is None else tn_comm))
    hw = hardware if hardware is not None else Hardware.default()
    c_hw = hw._c()
    t = (ctypes.c_double * max(hw.c_max, 1))()
    best = ctypes.c_int32()
    _check(_load().tw_tp_select(ctypes.byref(wl), ctypes.byref(c_hw), ctypes.byref(best), t))
    return best.value, list(t[:hw.c_max])


# ------------------------------------------------------------------------------------------------
# GPU entry points: tilewave.torch (contexts on in-process teams or NCCL communicators, the
# whole layer, dispatch and combine on torch tensors). It imports torch; this module never does,
# and the planning API above keeps working without torch or a GPU.
# ------------------------------------------------------------------------------------------------
