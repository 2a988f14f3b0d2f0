"""`buildifier_binary`: buildifier from npm's @bazel/buildifier package, checked by sha256.

npm is the only registry here that ships a buildifier binary. The binary is kept in the
per-user Kitchen cache so that `bazel clean --expunge` and other clones do not fetch it again.
"""

def _buildifier_binary_impl(rctx):
    home = rctx.os.environ.get("HOME", "/tmp")
    cache = rctx.os.environ.get("KITCHEN_CACHE_DIR") or (
        rctx.os.environ.get("XDG_CACHE_HOME", home + "/.cache") + "/kitchen"
    )
    cached = "{}/buildifier-{}/buildifier".format(cache, rctx.attr.version)
    if not rctx.path(cached).exists:
        npm = rctx.which("npm")
        if not npm:
            fail("buildifier: npm is needed once to fetch @bazel/buildifier (apt-get install npm)")
        result = rctx.execute([npm, "pack", "--silent", "@bazel/buildifier@" + rctx.attr.version], timeout = 600)
        if result.return_code != 0:
            fail("buildifier: `npm pack @bazel/buildifier@{}` failed:\n{}".format(rctx.attr.version, result.stderr))
        tarball = result.stdout.strip().splitlines()[-1]
        rctx.extract(tarball, output = "npm")
        rctx.execute(["mkdir", "-p", cached.rsplit("/", 1)[0]])
        rctx.execute(["cp", "npm/package/buildifier-linux_amd64", cached + ".tmp"])
        rctx.execute(["mv", cached + ".tmp", cached])
        rctx.delete("npm")
        rctx.delete(tarball)
    rctx.symlink(cached, "buildifier")
    got = rctx.execute(["sha256sum", "buildifier"]).stdout.split(" ")[0]
    if got != rctx.attr.sha256:
        fail("buildifier: {} has sha256 {}, expected {}".format(cached, got, rctx.attr.sha256))
    rctx.file("BUILD.bazel", 'exports_files(["buildifier"])\n')

buildifier_binary = repository_rule(
    implementation = _buildifier_binary_impl,
    attrs = {
        "sha256": attr.string(mandatory = True),
        "version": attr.string(mandatory = True),
    },
    environ = ["KITCHEN_CACHE_DIR", "XDG_CACHE_HOME"],
)
