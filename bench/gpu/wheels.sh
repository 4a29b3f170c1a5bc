# Sourced by the build modes of bench/gpu/run_*.sh (here, never there): the cp312 manylinux
# x86_64 wheels a GPU node's Python 3.12 installs with `pip install --no-index --no-deps`,
# each at the version this checkout's environment has.

# the daemon's dependencies a serve-only daemon without HTTP imports (the rest of its
# metadata's, the compiler and torch among them, are not needed to serve a store);
# typing-extensions for TVM-FFI, which an image's bare Python 3.12 lacks (an H100 image, 2026-12-07)
DAEMON_DEPS=(apache-tvm-ffi typing-extensions sqlite-utils click click-default-group
             python-dateutil tzdata pluggy tabulate sqlite-fts4 prometheus-client)

# cp312_wheels PY DIR PKG...: each PKG's wheel at the version PY's environment has, into
# DIR (a wheel already there is not fetched again)
cp312_wheels() {
  local py=$1 dir=$2 pkg ver
  shift 2
  mkdir -p "$dir"
  for pkg in "$@"; do
    ver=$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))")
    ls "$dir/${pkg//-/_}-$ver"-*.whl >/dev/null 2>&1 && continue
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$dir" "$pkg==$ver"
  done
}
