"""Why a GPU test cannot run here, or None: the Python GPU tests' shared skip rule."""


def missing_hopper(torch):
    """A sentence saying why torch's current GPU cannot run tilewave's kernels (no CUDA GPU, or
    not sm_90, the only target they are built for), or None when it can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return ("GPU %s is sm_%d%d; tilewave's kernels are built for sm_90a (Hopper)"
                % (torch.cuda.get_device_name(), *cap))
    return None
