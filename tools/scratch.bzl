"""`scratch_cmd`: a genrule's command run in a scratch HOME and TMPDIR, each process on one
thread: what a build action that trains (a test fixture built once, used by many tests) needs
to be hermetic (nothing read from the user's home) and to share the cores with the actions
beside it. The scratch directory is removed after; the command's exit status is the action's."""

def scratch_cmd(command):
    """The genrule `cmd` that runs `command` (already in genrule syntax) that way.

    Args:
      command: the command line, with $(execpath ...) and $@ as genrule expands them.

    Returns:
      The `cmd` string.
    """
    return " ".join([
        "tmp=$$(mktemp -d) &&",
        "HOME=$$tmp TMPDIR=$$tmp OMP_NUM_THREADS=1 MKL_NUM_THREADS=1",
        command + ";",
        "rc=$$?; rm -rf $$tmp; exit $$rc",
    ])
