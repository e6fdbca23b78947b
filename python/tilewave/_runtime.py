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
                ("dispatch", ctypes.c_int32), ("layer", ctypes.c_int32),
                ("dispatch_capacity", ctypes.c_int32)]


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
                ("comm_ctas", ctypes.c_int32), ("sm_budget", ctypes.c_int32),
                ("dispatch_ctas", ctypes.c_int32)]


class _CContextInfo(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int32), ("world_size", ctypes.c_int32),
                ("device", ctypes.c_int32), ("sm_count", ctypes.c_int32),
                ("timeout_ms", ctypes.c_int32), ("debug_tags", ctypes.c_int32),
                ("max_comm_ctas", ctypes.c_int32), ("window_bytes", ctypes.c_int64),
                ("nccl_version", ctypes.c_int32), ("unit_tiles", ctypes.c_int32),
                ("consumer_copy", ctypes.c_int32), ("dataflow", ctypes.c_int32),
                ("sm_budget", ctypes.c_int32), ("in_process", ctypes.c_int32)]


_c_int, _c_i32, _c_p, _P = ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER

# Argument types of every runtime function (each returns tw_status, a C int).
SIGNATURES = {
    "tw_team_create": [_c_i32, _c_i32, _P(_c_p)],
    "tw_team_destroy": [_c_p],
    "tw_context_create": [_P(_CProblem), _c_p, _P(_CContextConfig), _P(_c_p)],
    "tw_context_create_on_team": [_P(_CProblem), _c_p, _c_i32, _P(_CContextConfig), _P(_c_p)],
    "tw_context_destroy": [_c_p],
    "tw_context_info_get": [_c_p, _P(_CContextInfo)],
    "tw_context_check": [_c_p],
    "tw_context_reset": [_c_p],
    "tw_context_abort": [_c_p],
    "tw_context_dispatch_buffer": [_c_p, _P(_c_p), _P(ctypes.c_int64)],
    "tw_device_plan_create": [_c_p, _P(_c_p)],
    "tw_device_plan_destroy": [_c_p],
    "tw_device_plan_summary_get": [_c_p, _P(_CPlanSummary)],
    "tw_device_plan_expert_rows": [_c_p, _P(_c_i32), _P(_c_i32), _P(_c_i32)],
    # ctx, dplan, x, topk_ids, id_type, topk_weights, tokens, expert_in*, options, stream
    "tw_moe_dispatch_ex": [_c_p, _c_p, _c_p, _c_p, _c_int, _c_p, _c_i32, _P(_c_p),
                           _P(_CDispatchOptions), _c_p],
    # ctx, dplan, expert_in, w2, out, options, stream
    "tw_moe_combine_ex": [_c_p, _c_p, _c_p, _c_p, _c_p, _P(_CCombineOptions), _c_p],
    # ctx, dplan, x, topk_ids, id_type, topk_weights, tokens, w13, w2, out, options, stream
    "tw_moe_layer_ex": [_c_p, _c_p, _c_p, _c_p, _c_int, _c_p, _c_i32, _c_p, _c_p, _c_p,
                        _P(_CLayerOptions), _c_p],
}


def declare(lib):
    """Sets restype and argtypes of every runtime function on the loaded libtilewave."""
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = args
    return lib
