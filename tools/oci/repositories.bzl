"""Repository rules for the images' slow, rarely changing parts, cached per user.

  kitchen_debian_base    a Debian rootfs from mmdebstrap (the base image)
  kitchen_oci_base       a base image supplied by the user, pinned by digest
  kitchen_python_layers  the Python dependency layers, from requirements.lock

Each runs a helper script (base_image.py, python_layers.py) that builds its output once in
~/.cache/kitchen/oci/ (or $KITCHEN_CACHE_DIR/oci/), keyed by the rule's inputs and the helper
code, and prints the directory; the repository only links to those files. So `bazel clean
--expunge`, a second clone, or a changed app file never rebuild them, and a changed lock,
spec or package list does.
"""

_BASE_BUILD = """\
load("@//tools/oci:oci.bzl", "oci_base_import", "oci_layer_import")

package(default_visibility = ["//visibility:public"])

{layers}
oci_base_import(
    name = "base",
    config = "config.json",
    layers = [{names}],
)
"""

_LAYER = """\
oci_layer_import(
    name = "{name}",
    blob = "{name}.tar.gz",
    descriptor = "{name}.json",
    created_by = {created_by},
)
"""

def _run_helper(rctx, python, script, args):
    """Runs a helper under tools/oci with the repository root on PYTHONPATH; returns its output dir."""

    # Resolving the helper's modules by label makes Bazel re-run this rule when they change.
    for module in ["layer_tar.py", "layout.py"]:
        rctx.path(Label("//tools/oci:" + module))
    rctx.path(Label("//tools:cache_dir.py"))
    root = rctx.path(Label("//:WORKSPACE")).dirname
    result = rctx.execute(
        [python, rctx.path(Label("//tools/oci:" + script))] + args,
        environment = {"PYTHONPATH": str(root)},
        timeout = 3600,
        quiet = False,
    )
    if result.return_code != 0:
        fail("{}: {} failed:\n{}".format(rctx.name, script, result.stderr))
    return result.stdout.strip().splitlines()[-1]

def _link_base(rctx, out):
    rctx.symlink(out + "/config.json", "config.json")
    layers, names = [], []
    for i, created_by in enumerate(rctx.read(out + "/layers.txt").splitlines()):
        name = "layer{}".format(i)
        rctx.symlink("{}/{}.tar.gz".format(out, name), name + ".tar.gz")
        rctx.symlink("{}/{}.json".format(out, name), name + ".json")
        layers.append(_LAYER.format(name = name, created_by = repr(created_by)))
        names.append('":{}"'.format(name))
    rctx.file("BUILD.bazel", _BASE_BUILD.format(layers = "\n".join(layers), names = ", ".join(names)))

def _python3(rctx):
    python = rctx.which("python3")
    if not python:
        fail("{}: no python3 on PATH".format(rctx.name))
    return python

def _kitchen_debian_base_impl(rctx):
    out = _run_helper(rctx, _python3(rctx), "base_image.py", [
        "debian",
        "--suite",
        rctx.attr.suite,
        "--variant",
        rctx.attr.variant,
        "--architecture",
        rctx.attr.architecture,
        "--epoch",
        str(rctx.attr.source_date_epoch),
        "--mirror",
        rctx.attr.mirror,
        "--packages",
    ] + rctx.attr.packages)
    _link_base(rctx, out)

kitchen_debian_base = repository_rule(
    implementation = _kitchen_debian_base_impl,
    doc = "`@name//:base`: a one-layer Debian image from mmdebstrap, reproducible per mirror state.",
    attrs = {
        "suite": attr.string(default = "bookworm"),
        "variant": attr.string(default = "minbase"),
        "architecture": attr.string(default = "amd64"),
        "packages": attr.string_list(mandatory = True),
        "source_date_epoch": attr.int(mandatory = True),
        "mirror": attr.string(default = "http://deb.debian.org/debian"),
    },
    environ = ["KITCHEN_CACHE_DIR", "XDG_CACHE_HOME"],
)

def _kitchen_oci_base_impl(rctx):
    if bool(rctx.attr.layout) == bool(rctx.attr.image):
        fail("{}: give exactly one of layout (with digest) or image (NAME@sha256:...)".format(rctx.name))
    if rctx.attr.layout:
        args = ["import", "--layout", rctx.attr.layout, "--digest", rctx.attr.digest]
    else:
        args = ["import", "--image", rctx.attr.image]
    _link_base(rctx, _run_helper(rctx, _python3(rctx), "base_image.py", args))

kitchen_oci_base = repository_rule(
    implementation = _kitchen_oci_base_impl,
    doc = "`@name//:base`: an existing image as base, from an OCI layout or a registry, by digest.",
    attrs = {
        "layout": attr.string(doc = "absolute path of an OCI image layout directory"),
        "digest": attr.string(doc = "with layout: the manifest digest (sha256:...)"),
        "image": attr.string(doc = "registry reference pinned by digest: HOST/NAME@sha256:..."),
    },
    environ = ["KITCHEN_CACHE_DIR", "XDG_CACHE_HOME"],
)

_PYTHON_BUILD = """\
load("@//tools/oci:oci.bzl", "oci_layer_import")

package(default_visibility = ["//visibility:public"])

exports_files(glob(["*.packages.txt"]))

{layers}"""

def _lock_name(line):
    """The normalized package name of one `name==version` lock line ("" for none)."""
    name = line.split("#", 1)[0].strip().partition("==")[0].strip().lower()
    return name.replace("_", "-").replace(".", "-")

def _merged_lock(rctx):
    """`lock` with `overrides` laid over it (same name: replaced; new: added), as a file."""
    if not rctx.attr.overrides:
        return rctx.path(rctx.attr.lock)
    extra = [line.strip() for line in rctx.read(rctx.attr.overrides).splitlines() if _lock_name(line)]
    replaced = {_lock_name(line): True for line in extra}
    kept = [line for line in rctx.read(rctx.attr.lock).splitlines() if _lock_name(line) not in replaced]
    rctx.file("merged.lock", "\n".join(kept + extra) + "\n")
    return rctx.path("merged.lock")

def _kitchen_python_layers_impl(rctx):
    # The toolchain venv's python: its pip knows this machine's wheel sources (e.g. the
    # CPU torch wheel) and it has `packaging` for evaluating requirement markers.
    python = rctx.path(Label("@kitchen_venv//:python.sh"))
    spec = rctx.path(rctx.attr.spec)
    names = rctx.attr.layers or [layer["name"] for layer in json.decode(rctx.read(spec))["layers"]]
    out = _run_helper(rctx, python, "python_layers.py", [
        "--lock",
        _merged_lock(rctx),
        "--spec",
        spec,
        "--only",
    ] + names)
    layers = []
    for name in names:
        for suffix in [".tar.gz", ".json", ".packages.txt"]:
            rctx.symlink("{}/{}{}".format(out, name, suffix), name + suffix)
        packages = rctx.read("{}/{}.packages.txt".format(out, name)).splitlines()
        created_by = "pip install --no-deps --target " + " ".join(packages)
        layers.append(_LAYER.format(name = name, created_by = repr(created_by)))
    rctx.file("BUILD.bazel", _PYTHON_BUILD.format(layers = "\n".join(layers)))

kitchen_python_layers = repository_rule(
    implementation = _kitchen_python_layers_impl,
    doc = "One `@name//:<layer>` per chosen layer of the spec, holding the locked Python packages.",
    attrs = {
        "lock": attr.label(allow_single_file = True, mandatory = True),
        "spec": attr.label(allow_single_file = [".json"], mandatory = True),
        "layers": attr.string_list(doc = "the spec's layers to build here (default: all)"),
        "overrides": attr.label(
            allow_single_file = True,
            doc = "pins laid over `lock` (e.g. a CUDA torch and its NVIDIA libraries)",
        ),
    },
    environ = ["KITCHEN_CACHE_DIR", "XDG_CACHE_HOME"],
)
