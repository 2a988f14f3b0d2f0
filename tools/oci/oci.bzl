"""Kitchen's OCI image rules: reproducible layers, image layouts, and a push target.

rules_oci cannot be fetched offline, so these are small rules over standard-library Python
scripts (layer_tar.py, layout.py) and real tools (skopeo for pushing).

  oci_layer(name, srcs, prefix)           files/py_binary runfiles -> one .tar.gz layer
  oci_image(name, base, layers, ...)      -> <name>.oci/ (an OCI image layout directory)
  oci_push(name, image, repository)       `bazel run :name -- --registry HOST:PORT`
  oci_layer_import / oci_base_import      layers and bases made by repository rules

Same inputs give the same digests: see layer_tar.py for what is normalized. Label values may
contain `{STABLE_...}` placeholders, filled only in stamped builds (`--stamp`), so an
unstamped build never depends on the commit or the clock.
"""

OciLayerInfo = provider(
    doc = "One layer: its gzip blob and its descriptor JSON (mediaType, digest, size, diff_id).",
    fields = {
        "blob": "File: the layer's .tar.gz",
        "descriptor": "File: JSON descriptor of the blob, with the uncompressed diff_id",
        "created_by": "string: the config history entry for this layer",
    },
)

OciImageInfo = provider(
    doc = "An image usable as a base: its config and its layers, bottom first.",
    fields = {
        "config": "File: the image config JSON",
        "layers": "list of OciLayerInfo, bottom layer first",
    },
)

def _layer_file_arg(entry):
    rel, f = entry
    return "--file={}={}".format(rel, f.path)

def _oci_layer_impl(ctx):
    executables = {}
    for target in ctx.attr.srcs:
        exe = target[DefaultInfo].files_to_run.executable
        if exe and not exe.is_source:
            executables[exe.path] = True  # py_binary stubs point at this machine's venv
    files = depset(transitive = [t[DefaultInfo].files for t in ctx.attr.srcs] +
                                [t[DefaultInfo].default_runfiles.files for t in ctx.attr.srcs])
    entries = []
    for f in files.to_list():
        if f.path in executables:
            continue
        if f.short_path.startswith("../"):
            fail("oci_layer {}: {} comes from an external repository; put external files in a layer of their own".format(ctx.label, f.short_path))
        entries.append((f.short_path, f))
    if not entries:
        fail("oci_layer {}: srcs give no files".format(ctx.label))

    blob = ctx.actions.declare_file(ctx.label.name + ".tar.gz")
    descriptor = ctx.actions.declare_file(ctx.label.name + ".layer.json")
    args = ctx.actions.args()
    args.add("--prefix", ctx.attr.prefix)
    args.add("--level", ctx.attr.compression_level)
    args.add("--out", blob)
    args.add("--descriptor", descriptor)
    args.add_all(entries, map_each = _layer_file_arg)
    args.use_param_file("@%s", use_always = True)
    args.set_param_file_format("multiline")
    ctx.actions.run(
        executable = ctx.executable._write_layer,
        arguments = [args],
        inputs = [f for _, f in entries],
        outputs = [blob, descriptor],
        mnemonic = "OciLayer",
        progress_message = "Writing OCI layer %{label}",
    )
    return [
        DefaultInfo(files = depset([blob, descriptor])),
        OciLayerInfo(
            blob = blob,
            descriptor = descriptor,
            created_by = ctx.attr.created_by or "oci_layer {} -> {}".format(ctx.label, ctx.attr.prefix),
        ),
    ]

oci_layer = rule(
    implementation = _oci_layer_impl,
    doc = "A layer of the given files and the runfiles of the given targets, at PREFIX/short_path.",
    attrs = {
        "srcs": attr.label_list(allow_files = True, doc = "files, py_library or py_binary targets"),
        "prefix": attr.string(mandatory = True, doc = "absolute directory in the image"),
        "compression_level": attr.int(default = 6, doc = "gzip level; fixed per layer"),
        "created_by": attr.string(doc = "history entry; defaults to the label and prefix"),
        "_write_layer": attr.label(default = "//tools/oci:write_layer", executable = True, cfg = "exec"),
    },
)

def _oci_layer_import_impl(ctx):
    return [
        DefaultInfo(files = depset([ctx.file.blob, ctx.file.descriptor])),
        OciLayerInfo(blob = ctx.file.blob, descriptor = ctx.file.descriptor, created_by = ctx.attr.created_by),
    ]

oci_layer_import = rule(
    implementation = _oci_layer_import_impl,
    doc = "A layer made outside Bazel actions (by a repository rule).",
    attrs = {
        "blob": attr.label(allow_single_file = [".tar.gz"], mandatory = True),
        "descriptor": attr.label(allow_single_file = [".json"], mandatory = True),
        "created_by": attr.string(mandatory = True),
    },
)

def _oci_base_import_impl(ctx):
    return [
        DefaultInfo(files = depset([ctx.file.config])),
        OciImageInfo(config = ctx.file.config, layers = [layer[OciLayerInfo] for layer in ctx.attr.layers]),
    ]

oci_base_import = rule(
    implementation = _oci_base_import_impl,
    doc = "A base image made by a repository rule: its config JSON and its layers.",
    attrs = {
        "config": attr.label(allow_single_file = [".json"], mandatory = True),
        "layers": attr.label_list(providers = [OciLayerInfo], mandatory = True),
    },
)

def _oci_image_impl(ctx):
    base = ctx.attr.base[OciImageInfo] if ctx.attr.base else None
    layers = (base.layers if base else []) + [layer[OciLayerInfo] for layer in ctx.attr.layers]
    settings = {
        "base_config": base.config.path if base else None,
        "entrypoint": ctx.attr.entrypoint or None,
        "cmd": ctx.attr.cmd or None,
        "env": ctx.attr.env,
        "workdir": ctx.attr.workdir or None,
        "labels": ctx.attr.labels,
        "created_by": [layer[OciLayerInfo].created_by for layer in ctx.attr.layers],
    }
    settings_file = ctx.actions.declare_file(ctx.label.name + ".settings.json")
    ctx.actions.write(settings_file, json.encode(settings))

    layout = ctx.actions.declare_directory(ctx.label.name + ".oci")
    config = ctx.actions.declare_file(ctx.label.name + ".config.json")
    args = ctx.actions.args()
    args.add("--settings", settings_file)
    args.add("--out", layout.path)
    args.add("--config-out", config)
    inputs = [settings_file]
    if base:
        inputs.append(base.config)
    for layer in layers:
        args.add("--layer", layer.blob)
        args.add(layer.descriptor)
        inputs += [layer.blob, layer.descriptor]
    if ctx.attr.stamp:
        args.add("--status", ctx.info_file)
        inputs.append(ctx.info_file)
    ctx.actions.run(
        executable = ctx.executable._write_image,
        arguments = [args],
        inputs = inputs,
        outputs = [layout, config],
        mnemonic = "OciImage",
        progress_message = "Writing OCI image layout %{label}",
    )
    return [
        DefaultInfo(files = depset([layout]), runfiles = ctx.runfiles([layout])),
        OciImageInfo(config = config, layers = layers),
        OutputGroupInfo(config = depset([config])),
    ]

_oci_image = rule(
    implementation = _oci_image_impl,
    attrs = {
        "base": attr.label(providers = [OciImageInfo]),
        "layers": attr.label_list(providers = [OciLayerInfo]),
        "entrypoint": attr.string_list(),
        "cmd": attr.string_list(),
        "env": attr.string_dict(),
        "workdir": attr.string(),
        "labels": attr.string_dict(),
        "stamp": attr.bool(default = False),
        "_write_image": attr.label(default = "//tools/oci:write_image", executable = True, cfg = "exec"),
    },
)

def oci_image(name, base = None, layers = [], entrypoint = [], cmd = [], env = {}, workdir = "", labels = {}, **kwargs):
    """An OCI image layout directory `<name>.oci` (the target's only default output).

    Args:
      name: target name.
      base: an oci_image or oci_base_import; its layers come first and its config is
        extended (Env merged by variable, Labels merged, Entrypoint/Cmd/WorkingDir replaced).
      layers: oci_layer / oci_layer_import targets, bottom first.
      entrypoint: the image's Entrypoint (empty: keep the base's).
      cmd: the image's Cmd.
      env: environment variables.
      workdir: the working directory.
      labels: config labels; values may use `{STABLE_KEY}` placeholders filled when stamped.
      **kwargs: common attributes (visibility, tags, testonly).
    """
    _oci_image(
        name = name,
        base = base,
        layers = layers,
        entrypoint = entrypoint,
        cmd = cmd,
        env = env,
        workdir = workdir,
        labels = labels,
        stamp = select({
            "//tools/oci:stamped": True,
            "//conditions:default": False,
        }),
        **kwargs
    )

def oci_push(name, image, repository, tag = "latest", **kwargs):
    """`bazel run :name -- --registry HOST:PORT [--tag T]`: pushes `image` with skopeo.

    Args:
      name: target name.
      image: an oci_image target.
      repository: the repository in the registry, e.g. "kitchen/trainer".
      tag: the default tag.
      **kwargs: common attributes (visibility, tags).
    """
    native.py_binary(
        name = name,
        srcs = ["//tools/oci:push.py"],
        main = "//tools/oci:push.py",
        deps = ["//tools/oci:oci_lib"],
        data = [image],
        args = [
            "--layout",
            "$(rootpath {})".format(image),
            "--repository",
            repository,
            "--tag",
            tag,
        ],
        python_version = "PY3",
        **kwargs
    )
