"""`package_lint`: ruff and buildifier as test targets of the package that calls it.

Each package lints only its own files, so editing one package re-runs only its lint tests.
"""

def package_lint(name = "lint", extra_python = [], exclude = []):
    """Adds `ruff_test` and `buildifier_test` for this package's files, and a suite of both.

    Args:
      name: the test_suite holding both (`bazel test //pkg:lint`).
      extra_python: Python files outside the default glob (e.g. scripts without .py).
      exclude: globs to leave out.
    """
    python = native.glob(["*.py"], exclude = exclude + ["*_pb2.py", "*_pb2_grpc.py"]) + extra_python
    starlark = native.glob(["BUILD.bazel", "*.bzl", "WORKSPACE"], exclude = exclude)
    tests = [":buildifier_test"]
    if python:
        tests.append(":ruff_test")
        native.py_test(
            name = "ruff_test",
            srcs = ["//tools/lint:ruff_check.py"],
            main = "//tools/lint:ruff_check.py",
            args = ["$(rootpath //:ruff.toml)"] + ["$(rootpath {})".format(f) for f in python],
            data = python + ["//:ruff.toml"],
            size = "small",
            tags = ["lint"],
            python_version = "PY3",
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
    )
    native.test_suite(
        name = name,
        tests = tests,
        tags = ["lint"],
    )
