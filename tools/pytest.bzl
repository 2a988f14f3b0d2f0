"""`pytest_test`: one `*_test.py` file, run by pytest, as its own py_test."""

def pytest_test(name, srcs, deps = [], data = [], env = {}, args = [], size = "small", tags = [], **kwargs):
    """A py_test whose main runs pytest on `srcs` and writes JUnit XML for Bazel.

    Args:
      name: target name, by convention the test file's name without `.py`.
      srcs: the test file(s).
      deps: libraries under test.
      data: files the test reads at run time.
      env: environment variables (e.g. TRITON_INTERPRET).
      args: extra pytest arguments.
      size: Bazel's size; it sets the timeout, so set it honestly.
      tags: Bazel tags.
      **kwargs: passed to py_test.
    """
    runner = "//tools/pytest:runner.py"
    native.py_test(
        name = name,
        srcs = srcs + [runner],
        main = runner,
        args = ["$(rootpath {})".format(src) for src in srcs] + args,
        deps = deps,
        data = data,
        env = env,
        size = size,
        tags = tags,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
