#!/bin/sh
# Bazel --workspace_status_command for stamped image builds:
#   ./bazel build --stamp --workspace_status_command=tools/oci/workspace_status.sh //images:trainer
# STABLE_GIT_COMMIT fills the images' org.opencontainers.image.revision label; a tree with
# modified tracked files says so ("<sha>-dirty") instead of claiming a commit it is not.
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit-dirty"
fi
echo "STABLE_GIT_COMMIT $commit"
