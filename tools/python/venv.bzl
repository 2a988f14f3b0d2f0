"""`kitchen_venv`: a Python toolchain backed by a virtual environment built from a lock file.

The repository rule runs make_venv.py, which builds the venv once per lock hash in a per-user
cache and prints its path. The toolchain's interpreter path contains that hash, so a changed
lock changes every Python action's key (cached test results are invalidated) while an
unchanged lock reuses the venv and the cache.
"""

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

# The venv's interpreter; its path embeds the lock hash ({key}).
py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

# The venv's python, for genrules and tools (protoc); `$(location @kitchen_venv//:python)`.
sh_binary(
    name = "python",
    srcs = ["python.sh"],
    visibility = ["//visibility:public"],
)
"""

def _kitchen_venv_impl(rctx):
    python = rctx.which("python3")
    if not python:
        fail("kitchen venv: no python3 on PATH; install Python >= 3.11 (./bazel does this as root)")
    lock = rctx.path(rctx.attr.lock)
    script = rctx.path(rctx.attr._make_venv)
    rctx.path(rctx.attr._cache_dir)  # resolved so that a change to it re-runs this rule
    root = rctx.path(Label("//:WORKSPACE")).dirname
    result = rctx.execute(
        [python, script, "--lock", lock],
        environment = {"PYTHONPATH": str(root)},  # make_venv imports tools.cache_dir
        timeout = 3600,
        quiet = False,
    )
    if result.return_code != 0:
        fail("kitchen venv: could not build the Python environment:\n" + result.stderr)
    venv = result.stdout.strip().splitlines()[-1]
    interpreter = venv + "/bin/python3"
    rctx.file("python.sh", "#!/bin/sh\nexec {} \"$@\"\n".format(interpreter), executable = True)
    rctx.file("BUILD.bazel", _BUILD.format(python = interpreter, key = venv.split("/")[-1]))

kitchen_venv = repository_rule(
    implementation = _kitchen_venv_impl,
    attrs = {
        "lock": attr.label(allow_single_file = True, mandatory = True),
        "_cache_dir": attr.label(default = "//tools:cache_dir.py", allow_single_file = True),
        "_make_venv": attr.label(default = "//tools/python:make_venv.py", allow_single_file = True),
    },
    environ = ["KITCHEN_CACHE_DIR", "XDG_CACHE_HOME"],
    local = False,
)
