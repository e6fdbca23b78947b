#!/bin/sh
# `pip install .` of the repository into a throwaway virtual environment, then the installed
# package on its own: imported from outside the source tree with no TILEWAVE_LIBRARY and no
# PYTHONPATH, it must load the libtilewave.so inside it, leave torch unimported and plan a layer.
#   pip_install.sh SOURCE_DIR PYTHON WORK_DIR
# WORK_DIR keeps the wheel's CMake build directory (WORK_DIR/build) between runs, so a second run
# rebuilds nothing; the environment (WORK_DIR/venv) is made anew each time. The build backend
# (scikit-build-core) comes from the package index; where none can be reached the test is skipped
# (exit code 77) saying so. Prints "N passed, N failed".
set -u
src=$1 python=$2 work=$3
mkdir -p "$work"
venv=$work/venv
rm -rf "$venv"

if "$python" -m venv "$venv" >"$work/venv.log" 2>&1; then
  py=$venv/bin/python
  target_args=""
  pythonpath=""
else
  # No venv module (Debian's python3 without python3-venv): install into a directory instead.
  echo "no venv module ($(tail -1 "$work/venv.log")); installing with pip --target"
  py=$python
  rm -rf "$work/target"
  target_args="--target $work/target"
  pythonpath=$work/target
fi

# The build backend, installed where the build runs (--no-build-isolation below, so that the
# build uses it and the system's cmake and ninja instead of fetching them again).
if ! PYTHONPATH=$pythonpath "$py" -m pip install -q $target_args "scikit-build-core>=0.10" \
    >"$work/backend.log" 2>&1; then
  echo "skipped: cannot install the build backend scikit-build-core (no package index reachable?):"
  tail -3 "$work/backend.log"
  exit 77
fi

start=$(date +%s)
if ! PYTHONPATH=$pythonpath "$py" -m pip install -q $target_args --no-build-isolation \
    -C build-dir="$work/build" "$src" >"$work/install.log" 2>&1; then
  echo "pip install failed:"
  tail -40 "$work/install.log"
  echo "0 passed, 1 failed"
  exit 1
fi
echo "pip install: $(( $(date +%s) - start )) s"

# From an empty directory, without the variables that point at a build tree.
cd "$work" || exit 1
env -u TILEWAVE_LIBRARY PYTHONPATH="$pythonpath" "$py" - <<'EOF'
import os, sys

passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    print("%s: %s%s" % ("ok" if ok else "FAIL", name, (" (%s)" % detail) if detail else ""))
    if ok:
        passed += 1
    else:
        failed += 1


import tilewave as tw

pkg = os.path.dirname(os.path.abspath(tw.__file__))
lib = os.path.abspath(tw.library_path())
check("the package is the installed one, not the source tree's",
      os.sep + "python" + os.sep + "tilewave" not in pkg, pkg)
check("it loads the libtilewave.so inside it", lib == os.path.join(pkg, "libtilewave.so"), lib)
check("tilewave.torch is installed", os.path.exists(os.path.join(pkg, "torch.py")))
check("import tilewave does not import torch", "torch" not in sys.modules)
try:  # the fresh environment has no torch
    import tilewave.torch
    check("tilewave.torch without torch: ImportError", False, "it imported")
except ImportError as e:
    check("tilewave.torch without torch: ImportError naming the fix", "pip install torch" in str(e),
          str(e))
p = tw.Problem.preset("deepseek-v2-lite", world_size=8, max_tokens=1024)
r = tw.Routing.generate(p, "moderate_skew", tokens_per_rank=1024, seed=7)
s = tw.Plan(p, r, 0).summary
check("a plan from the installed library", s["comm_ctas"] >= 1 and s["rows"] > 0,
      "C %d, rows %d" % (s["comm_ctas"], s["rows"]))
from importlib.metadata import version as dist_version
check("the wheel's version is the library's", dist_version("tilewave") == tw.version(),
      "%s, %s" % (dist_version("tilewave"), tw.version()))
print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
EOF
