"""`package_lint`: ruff, mypy and buildifier as test targets of the package that calls it.

Each package lints only its own files, so editing one package re-runs only its lint tests.
Call it last in a BUILD file: the mypy test takes the Python libraries defined before it (and the
deps of the binaries and tests) as data, so that the modules (and generated proto stubs) its
files import are there to be followed.
"""

_PYTHON_RULES = ("py_library", "py_binary", "py_test")

def package_lint(name = "lint", extra_python = [], exclude = [], mypy_deps = []):
    """Adds `ruff_test`, `mypy_test` and `buildifier_test` for this package's files, and a suite.

    Args:
      name: the test_suite holding them all (`bazel test //pkg:lint`).
      extra_python: Python files outside the default glob (e.g. scripts without .py).
      exclude: globs to leave out.
      mypy_deps: what scripts that are no target's srcs import (for mypy to follow).
    """
    python = native.glob(["*.py"], exclude = exclude + ["*_pb2.py", "*_pb2_grpc.py"]) + extra_python
    starlark = native.glob(["BUILD.bazel", "*.bzl", "WORKSPACE"], exclude = exclude)
    tests = [":buildifier_test"]
    if python:
        tests += [":ruff_test", ":mypy_test"]
        native.py_test(
            name = "ruff_test",
            srcs = ["//tools/lint:ruff_check.py"],
            main = "//tools/lint:ruff_check.py",
            args = ["$(rootpath //:ruff.toml)"] + ["$(rootpath {})".format(f) for f in python],
            data = python + ["//:ruff.toml"],
            size = "small",
            tags = ["lint"],
            python_version = "PY3",
            deps = ["//tools/lint:junit"],
        )

        # What the package's files import: its libraries, and the deps of its binaries and
        # tests (not the tests themselves, whose data may be costly to build: images).
        imports = {}
        for rule in native.existing_rules().values():
            if rule["kind"] == "py_library":
                imports[":" + rule["name"]] = True
            elif rule["kind"] in _PYTHON_RULES and rule["name"] != "ruff_test":
                for dep in rule.get("deps", []):
                    imports[dep] = True
        native.py_test(
            name = "mypy_test",
            srcs = ["//tools/lint:mypy_check.py"],
            main = "//tools/lint:mypy_check.py",
            args = ["$(rootpath //:mypy.ini)"] + ["$(rootpath {})".format(f) for f in python],
            data = python + imports.keys() + mypy_deps + ["//:mypy.ini"],
            # Following the imports takes 2-29 s at load average 9-17 on 2 cores (trainer's
            # the most; tools/test_times.md): 60 s is too close.
            size = "medium",
            tags = ["lint"],
            python_version = "PY3",
            deps = ["//tools/lint:junit"],
        )
    native.py_test(
        name = "buildifier_test",
        srcs = ["//tools/lint:buildifier_check.py"],
        main = "//tools/lint:buildifier_check.py",
        args = ["$(rootpath @buildifier//:buildifier)"] + ["$(rootpath {})".format(f) for f in starlark],
        data = starlark + ["@buildifier//:buildifier"],
        size = "small",
        tags = ["lint"],
        python_version = "PY3",
        deps = ["//tools/lint:junit"],
    )
    native.test_suite(
        name = name,
        tests = tests,
        tags = ["lint"],
    )
