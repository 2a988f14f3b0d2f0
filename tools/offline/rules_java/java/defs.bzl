"""A stand-in for rules_java that forwards each rule to Bazel 4.2.3's native one (offline)."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_test = native.java_test
java_toolchain = native.java_toolchain
java_runtime = native.java_runtime
java_plugin = native.java_plugin
java_package_configuration = native.java_package_configuration
