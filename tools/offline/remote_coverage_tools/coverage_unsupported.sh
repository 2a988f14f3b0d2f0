#!/bin/sh
echo "bazel coverage is not supported offline; measure coverage with pytest-cov inside a test" >&2
exit 1
