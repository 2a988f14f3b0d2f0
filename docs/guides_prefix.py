"""The guides several groups start with (docs/guides_test.py GROUPS: precook, pretrain and sft
before rlhf and before interop), run once by a Bazel action (docs/BUILD.bazel:
`guides_prefix_tar`) the way guides_test runs them, and their workspace packed into a tarball
that those groups unpack instead of training the same models again:

    guides_prefix OUT.tar GUIDE.md...   # GUIDE_BINARIES set as for guides_test

A command that fails fails the action, and so every test that needs the tarball.
"""

import sys
import tempfile
from pathlib import Path

from docs import guides_test as guides
from trainer.testing import pack_tree


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: guides_prefix OUT.tar GUIDE.md...", file=sys.stderr)
        return 2
    out, names = Path(args[0]), args[1:]
    with tempfile.TemporaryDirectory(prefix="guides-prefix-") as tmp:
        workspace = guides.new_workspace(Path(tmp) / "checkout")
        env = guides.guide_env(workspace)
        for name in names:
            print("\n".join(guides.run_guide(name, workspace, env)), flush=True)
        pack_tree(workspace, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
