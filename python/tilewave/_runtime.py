"""The runtime half of the C API (include/tilewave.h) for ctypes: config and options structs,
their magics and the function signatures. No torch here: tilewave.torch uses it, and
tests/python/test_binding.py checks every struct's size and field offsets against the header
(compiled with the C compiler) on machines without torch.
"""

import ctypes

from tilewave import _CPlanConfig, _CPlanSummary, _CProblem

_CONTEXT_CONFIG_MAGIC = 0x74774378
_COMBINE_OPTIONS_MAGIC = 0x7477436F
_DISPATCH_OPTIONS_MAGIC = 0x74774470
_LAYER_OPTIONS_MAGIC = 0x74774C79
_MODES = {"overlap": 0, "unfused": 1}  # tw_combine_mode of the layer's and combine's GEMM2 half
_ERR_NCCL = 18
_DATAFLOW_REDUCE = 1


class _CContextConfig(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("timeout_ms", ctypes.c_int32), ("debug_tags", ctypes.c_int32),
                ("max_comm_ctas", ctypes.c_int32), ("timing", ctypes.c_int32),
                ("unit_tiles", ctypes.c_int32), ("consumer_copy", ctypes.c_int32),
                ("dataflow", ctypes.c_int32), ("sm_budget", ctypes.c_int32),
                ("dispatch", ctypes.c_int32), ("layer", ctypes.c_int32)]


class _CCombineOptions(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("mode", ctypes.c_int), ("comm_ctas", ctypes.c_int32),
                ("sm_budget", ctypes.c_int32)]


class _CDispatchOptions(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("plan_config", ctypes.POINTER(_CPlanConfig)), ("sm_budget", ctypes.c_int32)]


class _CLayerOptions(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("plan_config", ctypes.POINTER(_CPlanConfig)), ("mode", ctypes.c_int),
                ("comm_ctas", ctypes.c_int32), ("sm_budget", ctypes.c_int32)]


class _CContextInfo(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int32), ("world_size", ctypes.c_int32),
                ("device", ctypes.c_int32), ("sm_count", ctypes.c_int32),
                ("timeout_ms", ctypes.c_int32), ("debug_tags", ctypes.c_int32),
                ("max_comm_ctas", ctypes.c_int32), ("window_bytes", ctypes.c_int64),
                ("nccl_version", ctypes.c_int32), ("unit_tiles", ctypes.c_int32),
                ("consumer_copy", ctypes.c_int32), ("dataflow", ctypes.c_int32),
                ("sm_budget", ctypes.c_int32), ("in_process", ctypes.c_int32)]


def declare(lib):
    """Sets restype and argtypes of every runtime function on the loaded libtilewave."""
    c_int, c_i32, c_p = ctypes.c_int, ctypes.c_int32, ctypes.c_void_p
    P = ctypes.POINTER
    sigs = {
        "tw_team_create": [c_i32, c_i32, P(c_p)],
        "tw_team_destroy": [c_p],
        "tw_context_create": [P(_CProblem), c_p, P(_CContextConfig), P(c_p)],
        "tw_context_create_on_team": [P(_CProblem), c_p, c_i32, P(_CContextConfig), P(c_p)],
        "tw_context_destroy": [c_p],
        "tw_context_info_get": [c_p, P(_CContextInfo)],
        "tw_context_check": [c_p],
        "tw_context_reset": [c_p],
        "tw_context_abort": [c_p],
        "tw_context_dispatch_buffer": [c_p, P(c_p), P(ctypes.c_int64)],
        "tw_device_plan_create": [c_p, P(c_p)],
        "tw_device_plan_destroy": [c_p],
        "tw_device_plan_summary_get": [c_p, P(_CPlanSummary)],
        "tw_moe_dispatch_ex": [c_p, c_p, c_p, c_p, c_int, c_p, c_i32, P(c_p),
                               P(_CDispatchOptions), c_p],
        "tw_moe_combine_ex": [c_p, c_p, c_p, c_p, c_p, P(_CCombineOptions), c_p],
        "tw_moe_layer_ex": [c_p, c_p, c_p, c_p, c_int, c_p, c_i32, c_p, c_p, c_p,
                            P(_CLayerOptions), c_p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.restype = c_int
        fn.argtypes = args
    return lib
